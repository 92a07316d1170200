"""Benchmark (not a test): vllm-mlx's server, plain and under ``attnpass vllm-mlx serve``, with concurrent clients on
long prompts and a prefix-cached follow-up turn.

Run in the venv that has vllm-mlx (``make test-servers`` builds ``.venv-servers``). Models (``--families``), random,
saved to a temporary directory in float32 (vllm-mlx's batched bfloat16 answers vary from run to run):

- ``llama``: :func:`attnpass.models.save_tiny_lm` with ``--layers`` layers, ``--heads`` query / ``--kv-heads`` KV
  heads of dim 128, hidden ``--hidden`` (defaults 2, 8, 2, 512: small enough that attention over the long context
  is most of a call);
- ``deepseek_v32`` (MLA with a DSA indexer): benchmarks/mla_decode.py's per-head geometry (latent 512, rope 64,
  index_topk 2048, 64 indexer heads), ``--heads`` heads, ``--layers`` layers, dense MLPs, the same word tokenizer;
- ``qwen4_exp`` (QSA, an mlx-vlm model): :func:`attnpass.models.tiny_vlm.save_tiny_vlm`, served with ``--mllm``.

Two servers on 127.0.0.1 (free ports, both started at once): ``python -m vllm_mlx.cli serve`` and ``python -m
attnpass.cli vllm-mlx [--min-keys N] serve`` with the same flags: ``--engine batched`` (the default), with
``--continuous-batching`` (mlx-lm's ``BatchGenerator`` and vllm-mlx's prefix cache); ``--engine simple``, vllm-mlx's
default engine, one request at a time (lock admission ``wait``), with ``--prefix-trie-cache`` (mlx-lm's
``LRUPromptCache``). MLA models route in the simple engine only: in the batched one deepseek_v32's cache is a
``CacheList`` whose latent entry is a ``BatchKVCache`` (declined as ``cache_unrouted``).

For each ``--clients`` count and each ``--rounds`` round, each server gets the same conversation from that many
concurrent clients, the servers in turn and the order alternating per round (paired: both see the same load moments
apart; ``--control``: the second server plain too, which measures the method's noise): turn 1, each client's own
prompt of ``--context`` words (no prefix shared between clients, rounds or client counts), ``--max-tokens``
generated; turn 2, the same conversation with the answer and a follow-up of 16 words (vllm-mlx's prefix cache holds
turn 1), ``--max-tokens`` again. Every request is a streamed chat completion (greedy, temperature 0). Per turn the
table gives requests/s and generated tokens/s (the burst's wall time), the median time to first token (from the
request to its first content chunk), each as plain, attnpass and attnpass / plain (the median over rounds of the
paired ratios), and whether every answer of every round was plain's; stderr has each round's line as it ends. The
first round of each server also traces the optimized model's signatures at these depths; ``--warm-up`` runs one
untimed round first.

Concurrent answers are compared as they came, but they depend on how the server happened to batch the requests (which
streams were prefilled together, which one joined a running batch): the same requests can get other answers from plain
vllm-mlx itself when the timing differs. On qwen4_exp it does (by mlx-vlm's code, Qwen4-Exp attends its QSA selection in
an equal-length batch, every cached key in a left-padded decode step), so a slower first round under attnpass (its
traces) meets other batches than plain's and other answers; ``--control`` shows the rate between two plain servers. The
comparison that does not depend on timing: after the rounds, ``--alone N`` fresh prompts go to each server one request
at a time (a batch of one, the same on both), and the line ``one at a time`` says whether every answer was plain's.

On a shared machine compare the ratios. The prefix cache vllm-mlx saves at shutdown
(``~/.cache/vllm-mlx/prefix_cache/``, the temporary model's) is removed. The defaults (llama, 4 clients, 8,192-token
prompts, 2 rounds) took 18 minutes on 2 shared CPU cores; 16 clients there take about 4 times as long a burst.

    .venv-servers/bin/python benchmarks/vllm_mlx_server.py [--families llama deepseek_v32 qwen4_exp]
        [--clients 4 16] [--context 8192] [--max-tokens 16] [--rounds 2] [--warm-up] [--min-keys N]
        [--engine batched|simple] [--control] [--alone 1] [--layers 2] [--heads 8] [--kv-heads 2] [--hidden 512]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mlx_lm_server import LoggedServer  # tests/cli/servers.py's, as this script's sibling loads it

ROOT = Path(__file__).resolve().parent.parent

FOLLOW_UP = 16  # words of the second turn's new question
ALONE = 900_000_000  # the seeds of --alone's prompts (the rounds' are below)
VARIANTS = ("plain", "optimize")


@dataclass(frozen=True)
class Answer:
    """One streamed chat completion: its text, the tokens generated, the seconds to the first content chunk and
    to the end."""

    text: str
    tokens: int
    ttft: float
    seconds: float


class Server(LoggedServer):
    """vllm-mlx's server on 127.0.0.1 (``launcher``: the command line before ``serve``), its log in a file."""

    def __init__(self, launcher: list[str], model: Path, flags: list[str], log: Path) -> None:
        self.launcher, self.model, self.flags = launcher, model, flags
        env = os.environ | {"HF_HUB_OFFLINE": "1", "VLLM_MLX_SIMPLE_ENGINE_LOCK_ADMISSION": "wait"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        super().__init__(log, env)

    def command(self) -> list[str]:
        return [*self.launcher, "serve", str(self.model), "--host", "127.0.0.1", "--port", str(self.port), *self.flags]

    def chat(self, messages: list[dict], max_tokens: int) -> Answer:
        """``messages`` as one streamed, greedy chat completion."""
        body = {"model": str(self.model), "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        start = time.perf_counter()
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        try:
            connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
            text, chunks, tokens, first = [], 0, None, None
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"].get("completion_tokens", tokens)
                for choice in event.get("choices", []):
                    if content := (choice.get("delta") or {}).get("content"):
                        first = first or time.perf_counter()
                        text.append(content)
                        chunks += 1
            end = time.perf_counter()
            return Answer("".join(text), chunks if tokens is None else tokens, (first or end) - start, end - start)
        finally:
            connection.close()


def save_model(family: str, directory: Path, args: argparse.Namespace) -> tuple[Path, list[str]]:
    """The saved model of ``family`` and the flags vllm-mlx needs for it."""
    if family == "llama":
        from attnpass.models import save_tiny_lm

        shape = {"layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads, "hidden": args.hidden}
        return save_tiny_lm(directory, "llama", dtype="float32", **shape), []
    if family == "deepseek_v32":
        import mlx.core as mx
        from mlx_lm.utils import save_model as save

        from mla_decode import DSA, GEOMETRY, model  # this script's folder, on sys.path as it runs

        from attnpass.models.tiny_lm import CHAT_TEMPLATE, _words

        directory.mkdir(parents=True)
        save(directory, model(family, args.heads, args.layers, mx.float32))
        config = {**GEOMETRY, **DSA, "model_type": family, "num_attention_heads": args.heads,
                  "num_key_value_heads": args.heads, "num_hidden_layers": args.layers,
                  "first_k_dense_replace": args.layers, "max_position_embeddings": 65536,
                  "eos_token_id": []}  # fmt: skip
        (directory / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        words = _words(GEOMETRY["vocab_size"])
        words.chat_template = CHAT_TEMPLATE
        words.save_pretrained(directory)
        return directory, []
    if family == "qwen4_exp":
        from attnpass.models.tiny_vlm import save_tiny_vlm

        return save_tiny_vlm(directory, "qwen4_exp"), ["--mllm"]
    raise SystemExit(f"unknown family {family!r}")


def prompt(family: str, words: int, seed: int) -> str:
    """``words`` random tokens of text for ``seed`` (the tiny word tokenizer's ``t1 .. t499``; the byte-level one of
    qwen4_exp reads lowercase letters, one token each): no two seeds share a prefix."""
    pick = random.Random(seed)
    if family == "qwen4_exp":
        return "".join(pick.choices("abcdefghijklmnopqrstuvwxyz", k=words))
    return " ".join(f"t{i}" for i in pick.choices(range(1, 500), k=words))


def conversation(
    servers: dict[str, Server], family: str, clients: int, args: argparse.Namespace, seed: int, order: tuple
) -> dict[str, list[tuple[list[Answer], float]]]:
    """Both turns from ``clients`` concurrent clients on each server, in ``order``: per variant, per turn, the
    answers and the burst's wall seconds."""
    base = (seed * 1000 + clients) * 1000  # prompts of their own per round and --clients count (clients < 500)
    firsts = [prompt(family, args.context, base + c) for c in range(clients)]
    found: dict[str, list[tuple[list[Answer], float]]] = {}
    for variant in order:
        server, turns = servers[variant], []
        histories = [[{"role": "user", "content": text}] for text in firsts]
        for turn in range(2):
            if turn:
                for c, history in enumerate(histories):
                    question = prompt(family, FOLLOW_UP, base + 500 + c)
                    history += [{"role": "assistant", "content": turns[0][0][c].text},
                                {"role": "user", "content": question}]  # fmt: skip
            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                answers = list(pool.map(lambda h, s=server: s.chat(h, args.max_tokens), histories))
            turns.append((answers, time.perf_counter() - start))
        found[variant] = turns
    return found


def bench_family(family: str, args: argparse.Namespace, tmp: Path) -> None:
    """Both servers on ``family``'s model, every ``--clients`` count: the table's rows and the routing summary."""
    model, extra = save_model(family, tmp / family, args)
    engine = ["--continuous-batching"] if args.engine == "batched" else ["--prefix-trie-cache"]
    flags = [*engine, "--timeout", "3600", *extra]
    attnpass = [sys.executable, "-m", "attnpass.cli", "vllm-mlx"]
    attnpass += [] if args.min_keys is None else ["--min-keys", str(args.min_keys)]
    launchers = {"plain": [sys.executable, "-m", "vllm_mlx.cli"], "optimize": attnpass}
    if args.control:
        launchers["optimize"] = launchers["plain"]
    servers = {v: Server(launchers[v], model, flags, tmp / f"{family}-{v}.log") for v in VARIANTS}
    try:
        for server in servers.values():
            server.wait_until(lambda s=server: s.get("/health")[0], 300, 0.5)
        print(f"\n{family}: {args.context}-word prompts, {args.max_tokens} tokens a turn, {args.rounds} round(s); "
              f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
        head = f"{'clients':>7} {'turn':>4} | {'req/s plain':>11} {'attnpass':>8} {'ratio':>5} | "
        head += f"{'tok/s plain':>11} {'attnpass':>8} {'ratio':>5} | "
        head += f"{'TTFT s plain':>12} {'attnpass':>8} {'ratio':>5} | same"
        print(head, flush=True)
        for clients in args.clients:
            if args.warm_up:
                conversation(servers, family, clients, args, args.rounds, VARIANTS)
            rounds = []
            for r in range(args.rounds):
                rounds.append(conversation(servers, family, clients, args, r, VARIANTS[:: 1 if r % 2 == 0 else -1]))
                for turn in range(2):  # each round as it ends, on stderr
                    print(
                        f"round {r + 1}:",
                        _row(clients, turn, [{v: rounds[-1][v][turn] for v in VARIANTS}]),
                        file=sys.stderr,
                    )
            for turn in range(2):
                print(_row(clients, turn, [{v: found[v][turn] for v in VARIANTS} for found in rounds]), flush=True)
        if args.alone:
            print(alone(servers, family, args), flush=True)
        status, body = servers["optimize"].get("/attnpass/summary")
        for loaded in json.loads(body)["models"] if status == 200 else []:
            print(f"attnpass: {loaded['summary']}")
        print(f"load average {os.getloadavg()[0]:.2f}")
    finally:
        ended = {v: server.stop() for v, server in servers.items()}
        # vllm-mlx saves its prefix cache at shutdown, under a folder named by the model's path (a temporary one)
        shutil.rmtree(Path.home() / ".cache/vllm-mlx/prefix_cache" / str(model).replace("/", "--"), ignore_errors=True)
    for variant, (_, log) in ended.items():
        if "Traceback" in log:
            print(f"{variant} server's log has a traceback ({servers[variant].log}):\n{log[-3000:]}")


def alone(servers: dict[str, Server], family: str, args: argparse.Namespace) -> str:
    """``--alone`` fresh prompts of ``--context`` words, to each server one request at a time (a batch of one, the
    same on both servers, whatever the timing): the line that says whether every answer was plain's."""
    prompts = [prompt(family, args.context, ALONE + n) for n in range(args.alone)]
    answers = {
        v: [servers[v].chat([{"role": "user", "content": text}], args.max_tokens).text for text in prompts]
        for v in VARIANTS
    }
    differ = [pair for pair in zip(answers["plain"], answers["optimize"]) if pair[0] != pair[1]]
    line = f"one at a time: {len(prompts) - len(differ)} of {len(prompts)} answers the same as plain's"
    return line + (f" (first that differs: {differ[0]!r:.300})" if differ else "")


def _row(clients: int, turn: int, rounds: list[dict[str, tuple[list[Answer], float]]]) -> str:
    """One line: per round and variant requests/s, tokens/s and median TTFT; medians and the paired ratios."""

    def measures(answers: list[Answer], seconds: float) -> tuple[float, float, float]:
        return (
            len(answers) / seconds,
            sum(a.tokens for a in answers) / seconds,
            statistics.median(a.ttft for a in answers),
        )

    measured = [{v: measures(*found[v]) for v in VARIANTS} for found in rounds]
    cells = []
    for i in range(3):
        plain = statistics.median(m["plain"][i] for m in measured)
        opt = statistics.median(m["optimize"][i] for m in measured)
        ratio = statistics.median(m["optimize"][i] / m["plain"][i] for m in measured)
        cells.append(
            f"{plain:>11.3g} {opt:>8.3g} {ratio:>5.2f}" if i < 2 else f"{plain:>12.3g} {opt:>8.3g} {ratio:>5.2f}"
        )
    pairs = [(p.text, o.text) for found in rounds for p, o in zip(found["plain"][0], found["optimize"][0])]
    differ = [pair for pair in pairs if pair[0] != pair[1]]
    line = f"{clients:>7} {turn + 1:>4} | " + " | ".join(cells) + f" | {not differ}"
    return line + (f" ({len(differ)} of {len(pairs)} differ; first: {differ[0]!r:.300})" if differ else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["llama"], choices=("llama", "deepseek_v32", "qwen4_exp"))
    parser.add_argument("--clients", type=int, nargs="+", default=[4])
    parser.add_argument("--context", type=int, default=8192, help="words (tokens) of each client's first prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warm-up", action="store_true", help="one untimed round per --clients count first")
    parser.add_argument("--min-keys", type=int, default=None, help="attnpass vllm-mlx --min-keys (default: optimize's)")
    parser.add_argument("--engine", choices=("batched", "simple"), default="batched")
    parser.add_argument("--control", action="store_true", help="the second server plain too: the method's noise")
    parser.add_argument(
        "--alone", type=int, default=1, help="fresh prompts asked one request at a time after the rounds, compared"
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            bench_family(family, args, Path(tmp))


if __name__ == "__main__":
    main()
