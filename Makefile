# `make test` and `make demo` each work on a fresh machine with Python 3.11 and pip:
# they create .venv if missing and install the package with what they need.
# `make demo` installs the core, mlx and jax (what examples/qwen38_attention.py imports);
# `make test` every extra the tests use, the peers (torch 2.13.0, transformers) included,
# and fails, not skips, the outside oracle that needs them (ATTNPASS_REQUIRE_PEERS=1).
# Each install has its own stamp, so `make demo` then `make test` installs the rest.
# `make test-core` runs the same suite in .venv-core, which has only the core
# dependencies and pytest: tests that need an extra (mlx, jax, mlx-vlm, torch, Graphviz) skip,
# saying which. CI runs both (.ci/run). Any non-zero pytest status fails the target,
# including 5 (no tests collected). `make versions` / `make versions-core` print the
# resolved versions of the key dependencies in each venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-test
STAMP_DEMO := $(VENV)/.installed-demo
VENV_CORE := .venv-core
PY_CORE := $(VENV_CORE)/bin/python
STAMP_CORE := $(VENV_CORE)/.installed
VENV_SERVERS := .venv-servers
PY_SERVERS := $(VENV_SERVERS)/bin/python
STAMP_SERVERS := $(VENV_SERVERS)/.installed
VENV_OLDEST := .venv-mlx-lm-oldest
PY_OLDEST := $(VENV_OLDEST)/bin/python
STAMP_OLDEST := $(VENV_OLDEST)/.installed
VENV_OPENAI := .venv-mlx-openai-server
PY_OPENAI := $(VENV_OPENAI)/bin/python
STAMP_OPENAI := $(VENV_OPENAI)/.installed

.PHONY: test test-servers test-mlx-openai-server test-mlx-lm-oldest versions-mlx-lm-oldest test-core demo versions versions-core fuzz zoo zoo-vlm zoo-dtypes bench clean peer-mlx-lm peer-mlx-vlm

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[mlx,jax,dev,clients,render,zoo,peers,libraries]"
	touch $(STAMP) $(STAMP_DEMO)

$(STAMP_DEMO): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[mlx,jax]"
	touch $(STAMP_DEMO)

$(PY_CORE):
	$(PYTHON) -m venv $(VENV_CORE)

$(STAMP_CORE): pyproject.toml | $(PY_CORE)
	$(PY_CORE) -m pip install --quiet --upgrade pip
	$(PY_CORE) -m pip install --quiet -e ".[dev]"
	touch $(STAMP_CORE)

test: $(STAMP)
	ATTNPASS_REQUIRE_PEERS=1 $(PY) -m pytest -q

test-core: $(STAMP_CORE)
	@$(PY_CORE) -c "import importlib.util as u, sys; \
	found = [m for m in ('mlx', 'jax', 'mlx_vlm', 'torch') if u.find_spec(m)]; \
	sys.exit(f'$(VENV_CORE) is not core-only: it has {found}' if found else 0)"
	$(PY_CORE) -m pytest -q

demo: $(STAMP_DEMO)
	$(PY) examples/qwen38_attention.py

versions: $(STAMP)
	@$(PY) .ci/versions.py

versions-core: $(STAMP_CORE)
	@$(PY_CORE) .ci/versions.py

# `make test-jax-newest`: the JAX tests on the newest jax pip resolves, in .venv-jax-newest (jax 0.11 on needs
# Python >= 3.12; .venv's 3.11 stops at 0.10.2): the mlx, jax, dev and zoo extras (flax, equinox and mlx-lm for the
# model tests; no mlx-vlm, torch or peers). The set: every test whose id names jax, xla or mesh (the jax parameter of
# each multi-target test, the importer's and the JAX backend's modules, the sharded-mesh and XLA-regime tests; about
# 1,000). PYTHON312: python3.12 if it runs, else pyenv's ~/.pyenv/versions/3.12*; with none the target fails saying
# so. The venv resolves once: remove it to resolve the newest again. Measured with jax 0.12.1 on 2 shared cores: a
# minute to install, 9 to test (1,010 tests; 6 minutes of CPU). `make versions-jax-newest` prints what it resolved.
PYTHON312 ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),$(if $(shell $(p) -c "" 2>/dev/null && echo y),$(p))))
VENV_NEWEST := .venv-jax-newest
PY_NEWEST := $(VENV_NEWEST)/bin/python
STAMP_NEWEST := $(VENV_NEWEST)/.installed

.PHONY: test-jax-newest versions-jax-newest clean-jax-newest

$(STAMP_NEWEST): pyproject.toml
	@test -n "$(PYTHON312)" || { echo "make: no Python >= 3.12 for $(VENV_NEWEST) (python3.12 does not run, ~/.pyenv/versions/3.12* has none): set PYTHON312=/path/to/python3.12" >&2; exit 1; }
	@$(PYTHON312) -c "import sys; sys.exit(0 if sys.version_info >= (3, 12) else 'make: PYTHON312=$(PYTHON312) is Python ' + sys.version.split()[0] + ', not >= 3.12')"
	$(PYTHON312) -m venv $(VENV_NEWEST)
	$(PY_NEWEST) -m pip install --quiet --upgrade pip
	$(PY_NEWEST) -m pip install --quiet -e ".[mlx,jax,dev,zoo]"
	touch $(STAMP_NEWEST)

test-jax-newest: $(STAMP_NEWEST)
	$(PY_NEWEST) -m pytest -q tests -k "jax or xla or mesh"

versions-jax-newest: $(STAMP_NEWEST)
	@$(PY_NEWEST) .ci/versions.py

clean: clean-jax-newest
clean-jax-newest:
	rm -rf $(VENV_NEWEST)

# `make zoo-jax-libraries`: the library zoo's MaxText and gemma rows (tests/models/test_library_zoo.py -k "maxtext or
# gemma": prefill and decode over each library's own cache, MLA, DeepSeek-V3.2's DSA, Gemma-2's sliding window,
# Gemma 3 and Gemma 4, f32 and bf16, and attnpass's jit on each decode step) in .venv-jax-libraries, Python >= 3.12
# (PYTHON312, as above; maxtext 0.2.5 requires it). maxtext goes in with --no-deps: it lists no requirements but its
# extras (cuda12, tpu: CUDA or TPU stacks and TensorFlow), so what its model code imports is named here. gemma 4.0.1
# and kauldron 1.4.4 (gemma's model code imports kauldron) go in with --no-deps too (kauldron requires xmanager,
# OpenCV, scikit-learn...): GEMMA_IMPORTS is what `from gemma import gm` and its models import (TensorFlow is the
# largest). tests/models/test_maxtext_sparse.py runs benchmarks/maxtext_sparse.py at 4,096 keys. Measured on 2 shared
# cores at load 7: 4.6 minutes to install from scratch in a clean clone, 4.5 minutes for the 37 zoo tests there.
VENV_LIBRARIES := .venv-jax-libraries
PY_LIBRARIES := $(VENV_LIBRARIES)/bin/python
STAMP_LIBRARIES := $(VENV_LIBRARIES)/.installed
MAXTEXT_IMPORTS := omegaconf pathwaysutils grain drjax qwix aqtp tokamax pillow tiktoken sympy
GEMMA_IMPORTS := lark ml_collections typeguard einops clu tensorflow tensorboard pandas mediapy tensorflow-datasets \
	chex dialog sentencepiece treescope orbax-checkpoint jaxtyping "etils[edc,enp,epath,epy,etree]"

.PHONY: zoo-jax-libraries clean-jax-libraries

$(STAMP_LIBRARIES): pyproject.toml
	@test -n "$(PYTHON312)" || { echo "make: no Python >= 3.12 for $(VENV_LIBRARIES): set PYTHON312=/path/to/python3.12" >&2; exit 1; }
	$(PYTHON312) -m venv $(VENV_LIBRARIES)
	$(PY_LIBRARIES) -m pip install --quiet --upgrade pip
	$(PY_LIBRARIES) -m pip install --quiet -e ".[mlx,jax,dev,zoo]" $(MAXTEXT_IMPORTS) $(GEMMA_IMPORTS)
	$(PY_LIBRARIES) -m pip install --quiet --no-deps maxtext==0.2.5 gemma==4.0.1 kauldron==1.4.4
	touch $(STAMP_LIBRARIES)

zoo-jax-libraries: $(STAMP_LIBRARIES)
	$(PY_LIBRARIES) -m pytest -q tests/models/test_library_zoo.py tests/models/test_maxtext_sparse.py -k "maxtext or gemma"

clean: clean-jax-libraries
clean-jax-libraries:
	rm -rf $(VENV_LIBRARIES)

# `make zoo-easydel`: the library zoo's EasyDeL rows (tests/models/test_library_zoo.py -k easydel: Llama, Qwen3,
# Mistral's sliding window, Gemma3, DeepSeek-V3's MLA with yarn RoPE, Llama with attn_mechanism="sdpa"; prefill and
# decode over EasyDeL's own cache, f32, bf16 and EasyDeL's default bf16 attention in an f32 model; attnpass's jit on
# each decode step) in
# .venv-easydel, a venv of its own: easydel 0.3.0 pins flax==0.12.3 and, through ejkernel 0.0.78, jax~=0.9.0, which
# the jax extra's jax>=0.10.2 excludes, so attnpass goes in with the mlx and dev extras only, beside easydel's own
# requirements (ray, transformers, datasets...: no GPU stack). Python: $(PYTHON) (easydel takes 3.11 to 3.13).
# EASYDEL_IMPORTS is what its model code imports beyond its requirements: pillow (its eSurge engine) and torch
# (its module registry patches transformers' torch-only GLM-4V-MoE classes); torch==2.13.0 is the CPU wheel these
# machines hold. Measured on 2 shared cores at load 4.6 (`rm -rf .venv-easydel; time make zoo-easydel`): 5.0 minutes,
# 2.8 to install (pip's cache warm; the first install, cache cold, took 2.5 without pillow and torch) and 2.2 for
# the 41 tests then (44 now, 2.1 minutes at load 4.3).
VENV_EASYDEL := .venv-easydel
PY_EASYDEL := $(VENV_EASYDEL)/bin/python
STAMP_EASYDEL := $(VENV_EASYDEL)/.installed
EASYDEL_IMPORTS := pillow torch==2.13.0

.PHONY: zoo-easydel clean-easydel

$(STAMP_EASYDEL): pyproject.toml
	$(PYTHON) -m venv $(VENV_EASYDEL)
	$(PY_EASYDEL) -m pip install --quiet --upgrade pip
	$(PY_EASYDEL) -m pip install --quiet -e ".[mlx,dev]" easydel==0.3.0 $(EASYDEL_IMPORTS)
	touch $(STAMP_EASYDEL)

zoo-easydel: $(STAMP_EASYDEL)
	$(PY_EASYDEL) -m pytest -q tests/models/test_library_zoo.py -k easydel

clean: clean-easydel
clean-easydel:
	rm -rf $(VENV_EASYDEL)

# The differential fuzzer beyond CI's 2,000 graphs: `make fuzz N=100000 SEED=1 JOBS=2` prints its rate and,
# on a failure, a shrunk reproducer with its replay command (tests/fuzz).
N ?= 100000
SEED ?= 0
JOBS ?= 2
fuzz: $(STAMP)
	$(PY) -m tests.fuzz --n $(N) --seed $(SEED) --jobs $(JOBS)

# The sweep over every model family of the installed mlx-lm: regenerates docs/mlx_lm_families.md
# (`make zoo JOBS=2`: families run at once, each in its own process; a few tens of minutes on 2 cores).
zoo: $(STAMP)
	$(PY) examples/mlx_lm_sweep.py --jobs $(JOBS) --write docs/mlx_lm_families.md

# The same sweep over every mlx-vlm family's language model: regenerates docs/mlx_vlm_families.md
# (`make zoo-vlm JOBS=2`: families run at once, each in its own process; about half an hour on 2 shared cores).
zoo-vlm: $(STAMP)
	$(PY) examples/mlx_vlm_sweep.py --jobs $(JOBS) --write docs/mlx_vlm_families.md

# Every mlx-lm family in float16, bfloat16 and float32 over the traced programs' bounds, plain and under
# optimize(check=True), raw bits compared: regenerates docs/mlx_lm_dtypes.md (`make zoo-dtypes JOBS=2`; about
# half an hour on 2 shared cores).
zoo-dtypes: $(STAMP)
	$(PY) examples/mlx_lm_dtypes.py --jobs $(JOBS) --write docs/mlx_lm_dtypes.md

# mlx-lm's own tests (the installed version's, from its sdist, fetched into .peer/ once), run plain and with every
# model they build optimized (then with check=True too), compared test by test: regenerates docs/peer_suites.md and
# fails if an outcome changed (`make peer-mlx-lm`; about five minutes on 2 cores). The peers are the records of
# examples/peers.py.
peer-mlx-lm: $(STAMP)
	$(PY) examples/peer_suite.py --peer mlx-lm --write docs/peer_suites.md

# mlx-vlm's own tests of language models, caches and generation, the same way: regenerates
# docs/peer_suites_mlx_vlm.md. Its releases ship no tests: they come from a git clone of its repository (tag v0.6.15,
# `git archive` into .peer/), MLX_VLM_GIT=DIR (default: examples/peers.py's mirror path, where it exists).
peer-mlx-vlm: $(STAMP)
	$(PY) examples/peer_suite.py --peer mlx-vlm $(if $(MLX_VLM_GIT),--git-dir $(MLX_VLM_GIT)) --write docs/peer_suites_mlx_vlm.md

# `make test-servers`: vllm-mlx 0.6.0's server beside `attnpass vllm-mlx serve` (tests/cli/test_launch_vllm_mlx.py) in a
# venv of its own: vllm-mlx pins mlx-lm 0.31 and pulls torchvision. torch 2.14.1 and torchvision 0.29.1 go first, the
# pair on this machine's disk (PyPI's torchvision beside its torch 2.13.0 fails to import, and transformers with it;
# an unpinned torch would download a CUDA build). Measured on 2 shared cores: 4.5 minutes to install, 2 to test (3.5
# at load 4-5, 2.2 at load 2, since both engine modes also run the unchanged vllm-mlx serve through `attnpass hook
# install`'s hook, and --mllm on the tiny Qwen4-Exp joined).
$(STAMP_SERVERS): pyproject.toml
	$(PYTHON) -m venv $(VENV_SERVERS)
	$(PY_SERVERS) -m pip install --quiet --upgrade pip
	$(PY_SERVERS) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY_SERVERS) -m pip install --quiet -e ".[mlx,dev]" vllm-mlx==0.6.0 mlx-lm==0.31.3 torch==2.14.1 \
		torchvision==0.29.1 openai
	touch $(STAMP_SERVERS)

test-servers: $(STAMP_SERVERS)
	$(PY_SERVERS) -m pytest -q tests/cli/test_launch_vllm_mlx.py

# `make test-mlx-openai-server`: mlx-openai-server 1.8.1 beside `attnpass mlx-openai-server launch`
# (tests/cli/test_launch_mlx_openai_server.py), in .venv-mlx-openai-server. The server pins mlx-lm 0.31 (>= 0.31.3),
# mlx-vlm 0.4, mflux 0.17 and mlx >= 0.31.2; mflux 0.17 pins mlx < 0.32 (on Linux as mlx[cuda13], whose 0.31 series
# has no 0.31.2: pip cannot resolve the server there). So mflux (image generation only) goes in without its requirements, and mlx[cpu] 0.31.2, the mlx that
# these pins leave, with the rest of both packages' requirements (.ci/requirements_of.py); attnpass without its
# mlx extra (mlx >= 0.32.4). torch and torchvision as in test-servers. attnpass is not supported on this mlx: the
# drop-in tests (tests/backends/mlx_backend) there gave 29 failed and 21 errors of 260 (mlx-vlm 0.4 lacks the families
# and caches of 0.7; routed float32 calls 1 ulp from mlx-lm's helper, not bit for bit; one run segfaulted in
# test_masks), so only the server's test runs. Measured on 2 shared cores (load 5-6): 5 minutes to install, 2.5 to test.
$(STAMP_OPENAI): pyproject.toml
	$(PYTHON) -m venv $(VENV_OPENAI)
	$(PY_OPENAI) -m pip install --quiet --upgrade pip packaging
	$(PY_OPENAI) -m pip install --quiet --no-deps mlx-openai-server==1.8.1 mflux==0.17.5
	$(PY_OPENAI) .ci/requirements_of.py mlx-openai-server mflux --drop mlx --drop mflux > $(VENV_OPENAI)/requirements.txt
	$(PY_OPENAI) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY_OPENAI) -m pip install --quiet -e ".[dev]" "mlx[cpu]==0.31.2" mlx-lm==0.31.3 torch==2.14.1 \
		torchvision==0.29.1 openai -r $(VENV_OPENAI)/requirements.txt
	touch $(STAMP_OPENAI)

test-mlx-openai-server: $(STAMP_OPENAI)
	$(PY_OPENAI) -m pytest -q tests/cli/test_launch_mlx_openai_server.py

# `make test-mlx-lm-oldest`: the drop-in tests on the oldest mlx-lm supported, 0.31.3 (what vllm-mlx 0.6.0,
# mlx-openai-server 1.8.1 and mlx-omni-server 0.5.3 pin), in .venv-mlx-lm-oldest: the mlx, dev and clients extras (mlx-vlm
# requires no mlx-lm) with mlx-lm==0.31.3, no jax, torch or flax. The set: tests/backends/mlx_backend, the mlx-lm
# CLI's tests/cli/test_launch*.py and tests/models/test_mlx_lm_sweep.py; what needs something not there, or a newer
# mlx-lm's feature (a family, a fixed cache), skips saying which. Left out: the RSS bound of test_launch_server (10% of
# the server's RSS; this lean venv's server is half the size, and plain mlx-lm 0.31.3's moved 170 -> 215 MiB over the
# same bursts), and the other tests that import mlx_lm (passes, lowering, docs: mlx-lm's helper as code to import,
# unchanged since 0.31) for the time. Measured on 2 shared cores (load 5-6): 1.5-2 minutes to install, 3-3.5 to test.
$(STAMP_OLDEST): pyproject.toml
	$(PYTHON) -m venv $(VENV_OLDEST)
	$(PY_OLDEST) -m pip install --quiet --upgrade pip
	$(PY_OLDEST) -m pip install --quiet -e ".[mlx,dev,clients]" mlx-lm==0.31.3
	touch $(STAMP_OLDEST)

test-mlx-lm-oldest: $(STAMP_OLDEST)
	$(PY_OLDEST) -m pytest -q tests/backends/mlx_backend $(wildcard tests/cli/test_launch*.py) \
		tests/models/test_mlx_lm_sweep.py \
		--deselect tests/cli/test_launch_server.py::test_the_optimized_servers_rss_stays_within_10_percent_after_the_warm_up

versions-mlx-lm-oldest: $(STAMP_OLDEST)
	@$(PY_OLDEST) .ci/versions.py

clean:
	rm -rf $(VENV) $(VENV_CORE) $(VENV_SERVERS) $(VENV_OLDEST) $(VENV_OPENAI) build *.egg-info .pytest_cache .hypothesis
