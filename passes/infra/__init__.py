"""The pass infrastructure: the pass contract, remarks, the manager, the registry, the rewrite driver, textual pipelines, policies, instrumentation and crash reproducers."""
