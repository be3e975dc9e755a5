"""A training-free yardstick for a drafter: how far copying from the context goes on a conversation file.

For every assistant answer, walk as the offline acceptance walk does (stage2_train/acceptance.py): the anchor is
the last accepted token; the "drafter" proposes the block-size - 1 tokens that followed the latest earlier
occurrence of the (previous token, anchor) pair in the same sequence (prompt included), nothing if there is none;
the accepted drafts are the prefix that equals the answer, and the walk moves on by accepted + 1. It reports that
copy drafter's tau and acceptance by block position, and the next-token accuracy of the same pair lookup.

Target-regenerated answers of a small target loop often, so copying alone can go far; a drafter that conditions
on the target's hidden states can learn to copy too (its attention sees every earlier position). The README's
H200 section compares the two on the same conversations.

    python benchmarks/copy_baseline.py --data generated.jsonl.gz --max-samples 1500 --out result.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import numpy as np

from dflash.stage2_train.acceptance import _run_ends, walk_acceptance
from dflash.stage2_train.cache_index import split_hash


def copy_walk(ids: np.ndarray, loss_mask: np.ndarray, block_size: int) -> tuple[list[int], int, int]:
    """(accepted drafts per walk step, pair-lookup next-token hits, tokens predicted) over the first answer.

    The walk is `walk_acceptance`, from the first answer position to the end of its loss-mask run, as the offline
    tau of training walks it; only the table of accepted counts comes from copying instead of a drafter.
    """
    answer = np.flatnonzero(loss_mask)
    if len(answer) == 0:
        return [], 0, 0
    start = int(answer[0])
    end = int(_run_ends(loss_mask)[start])  # one past the first loss-mask run, as `offline_acceptance` finds it
    latest: dict[tuple[int, int], int] = {}  # (ids[j - 1], ids[j]) -> the largest such j before the anchor
    accept_at: dict[int, int] = {}
    hits = 0
    for p in range(1, end - 1):
        key = (int(ids[p - 1]), int(ids[p]))
        if p >= start:
            earlier = latest.get(key)
            draft = ids[earlier + 1 : earlier + block_size] if earlier is not None else ids[:0]
            accepted = 0
            while accepted < len(draft) and p + 1 + accepted < len(ids) and draft[accepted] == ids[p + 1 + accepted]:
                accepted += 1
            accept_at[p] = accepted
            hits += accepted >= 1
        latest[key] = p
    return walk_acceptance(accept_at, start, end), hits, max(0, end - 1 - start)


@click.command()
@click.option("--data", required=True, help="Conversations (any file `dflash extract --data` takes).")
@click.option("--model", default=None, help="Target whose tokenizer and chat template to use (default: embedded).")
@click.option("--max-samples", type=int, default=None)
@click.option("--max-length", type=int, default=2048, show_default=True)
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--heldout-sequences", type=int, default=None,
              help="Only the first N held-out sequences of `dflash train` (same seed and eval fraction), i.e. the ones "
                   "its offline tau walks, when the cache was extracted from this same file.")
@click.option("--eval-fraction", type=float, default=0.05, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="JSON result file.")
def main(data: str, model: str | None, max_samples: int | None, max_length: int, block_size: int,
         heldout_sequences: int | None, eval_fraction: float, seed: int, out: Path) -> None:
    from dflash.shared.target_loading import load_tokenizer, resolve_target
    from dflash.stage1_extract.conversations import load_conversations, tokenize_conversation

    start = time.time()
    target = resolve_target(model)
    tokenizer = load_tokenizer(target.load_path)
    conversations = load_conversations(data, max_samples=max_samples).conversations
    if heldout_sequences is not None:  # the training eval's choice: split key < fraction, in split-key order
        keys = split_hash(np.array([c.index for c in conversations], dtype=np.int64), seed)
        order = [i for i in np.argsort(keys, kind="stable") if keys[i] < eval_fraction]
        conversations = [conversations[i] for i in order[:heldout_sequences]]
    steps: list[int] = []
    hits = tokens = samples = 0
    for conversation in conversations:
        sample = tokenize_conversation(tokenizer, conversation, max_length=max_length)
        if isinstance(sample, str):
            continue
        accepted, sample_hits, sample_tokens = copy_walk(sample.input_ids, sample.loss_mask.astype(bool),
                                                        block_size)
        steps += accepted
        hits += sample_hits
        tokens += sample_tokens
        samples += 1
    counts = np.asarray(steps)
    result = {
        "data": data, "target": target.display_name, "samples": samples, "supervised_tokens": tokens,
        "heldout_sequences": heldout_sequences, "block_size": block_size, "walk_steps": len(steps),
        "tau": float((counts + 1).mean()),
        "acceptance_by_position": [float((counts >= k).mean()) for k in range(1, block_size)],
        "pair_lookup_next_token_accuracy": hits / max(1, tokens),
        "seconds": round(time.time() - start, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "acceptance_by_position"}))


if __name__ == "__main__":
    main()
