"""The KV cache capacity planner: a model's KV cache per layer (model), vLLM's grouped allocation of
it (grouping), the cross-check against a running vLLM (stack_check), and the command line (cli)."""
