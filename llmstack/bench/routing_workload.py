"""The routing benchmark's prompts, sized in tokens by the served model's own tokenizer.

Standard library only, plus a tokenizer object passed in: the benchmark sends this file's source to
the Python that runs `vllm bench serve` (vLLM's container, or a bare host), which has the tokenizer.

  prefix-heavy  many users sharing a few dozen long system prompts (single questions), and
                multi-turn chats that resend their whole history each turn; the distinct system
                prompts are sized so that together they fill --working-set x one replica's KV cache
  prefix-light  unique prompts of the same length: nothing to reuse

Every run salts its text (run_salt), so no run finds another's prefixes in a cache.
"""

from __future__ import annotations

import json
import random
from typing import Any

WORDS = (  # noqa: SIM905 - a paragraph reads better than 72 quoted words
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river mountain forest ocean desert "
    "valley island bridge castle garden harbor market palace temple tower village window yellow orange "
    "purple silver golden copper marble granite crystal thunder lightning shadow sunrise sunset winter "
    "summer autumn spring morning evening midnight planet comet galaxy nebula quantum vector matrix tensor"
).split()


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def text_of_tokens(tokenizer: Any, rng: random.Random, tokens: int, head: str = "") -> str:
    """Text of about `tokens` tokens (within a few) by this tokenizer, starting with `head`."""
    text = head
    while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
        text += " " + words(rng, max(4, (tokens - len(tokenizer.encode(text, add_special_tokens=False))) // 2))
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    return tokenizer.decode(ids)


def build(spec: dict, tokenizer: Any) -> tuple[list[dict], dict]:
    """(rows for `vllm bench serve --dataset-name custom`, facts about them). Rows are in send order."""
    rng = random.Random(spec["seed"])
    salt = f"run {spec['salt']}:"
    output = spec["output_tokens"]
    requests = spec["requests"]
    question = spec["question_tokens"]
    if spec["workload"] == "prefix-light":
        length = spec["system_tokens"] + question
        rows = [
            {"prompt": text_of_tokens(tokenizer, rng, length, f"{salt} request {i}:"), "output_tokens": output}
            for i in range(requests)
        ]
        return rows, {"distinct_prefixes": 0, "prefix_tokens": 0}
    capacity = spec["replica_kv_tokens"]
    systems = max(2, round(spec["working_set"] * capacity / spec["system_tokens"]))
    system_prompts = [
        text_of_tokens(tokenizer, rng, spec["system_tokens"], f"{salt} system prompt {k}:") for k in range(systems)
    ]
    # Multi-turn chats: each turn resends the system prompt and the whole history, plus a new question.
    turns = spec["turns"]
    chats = max(1, round(requests * spec["multi_turn_share"] / turns))
    chat_rows: list[list[dict]] = []
    for chat in range(chats):
        system = system_prompts[rng.randrange(systems)]
        history = system
        rows_of_chat = []
        for turn in range(turns):
            history += "\nUser: " + text_of_tokens(tokenizer, rng, question, f"chat {chat} turn {turn}:")
            rows_of_chat.append({"prompt": history + "\nAssistant:", "output_tokens": output})
            history += "\nAssistant: " + text_of_tokens(tokenizer, rng, output)
        chat_rows.append(rows_of_chat)
    single = requests - chats * turns
    single_rows = [
        {
            "prompt": system_prompts[rng.randrange(systems)]
            + "\nUser: "
            + text_of_tokens(tokenizer, rng, question, f"question {i}:")
            + "\nAssistant:",
            "output_tokens": output,
        }
        for i in range(max(0, single))
    ]
    # Send order: single questions spread evenly, each chat's turns in order, chats interleaved.
    queue: list[dict] = []
    pending = [list(rows) for rows in chat_rows]
    position = 0
    while any(pending) or position < len(single_rows):
        for rows in pending:
            if rows:
                queue.append(rows.pop(0))
        step = max(1, len(single_rows) // max(1, turns))
        queue.extend(single_rows[position : position + step])
        position += step
    facts = {
        "distinct_prefixes": systems,
        "prefix_tokens": systems * spec["system_tokens"],
        "working_set_of_one_replica": round(systems * spec["system_tokens"] / capacity, 2),
        "chats": chats,
        "turns": turns,
    }
    return queue, facts


def write(spec: dict, tokenizer: Any, path: str) -> dict:
    rows, facts = build(spec, tokenizer)
    with open(path, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    facts["requests"] = len(rows)
    facts["prompt_tokens_mean"] = round(
        sum(len(tokenizer.encode(r["prompt"], add_special_tokens=False)) for r in rows) / max(1, len(rows)), 1
    )
    return facts
