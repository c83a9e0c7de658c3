"""Log-likelihoods per second through lm-eval: kvlab's adapter beside lm-eval's own ``hf``
backend, on the same HellaSwag requests and the same converted weights, in one process.

    python scripts/bench_lm_eval.py --items 1000 --backends kvlab:1,kvlab:8,kvlab:auto,hf:1,hf:8

Each backend scores a warm-up slice first, then every request (timed: ``loglikelihood``
alone, not model loading or task building). Scores are compared with the first ``hf``
backend's (acc, acc_norm and the largest per-request difference). To time an older kvlab,
run this script with ``PYTHONPATH`` pointing at that checkout.
"""

from __future__ import annotations

import argparse
import time

import torch
from lm_eval.tasks import TaskManager, get_task_dict

import kvlab.lm_eval_model  # noqa: F401  (registers lm-eval's model kvlab)
from kvlab.eval.harness import TASKS_DIR
from kvlab.models.loading import resolve_checkpoint
from kvlab.tracking import environment

TASK = "hellaswag_local"


def requests(items: int) -> tuple[object, list]:
    task = get_task_dict([TASK], TaskManager(include_path=str(TASKS_DIR)))[TASK]
    task.build_all_requests(limit=items, rank=0, world_size=1)
    return task, list(task.instances)


def backend(name: str, batch_size: str):
    size = batch_size if batch_size == "auto" else int(batch_size)
    if name == "kvlab":
        return kvlab.lm_eval_model.KvlabRunLM(dtype="float32", batch_size=size)
    from lm_eval.models.huggingface import HFLM

    checkpoint = str(resolve_checkpoint("smollm2-135m"))
    return HFLM(pretrained=checkpoint, dtype="float32", batch_size=size, device="cpu")


def accuracy(instances: list, scores: list) -> tuple[float, float]:
    """HellaSwag's acc and acc_norm (by characters of the ending) from the scores."""
    items: dict[int, list] = {}
    for instance, (logprob, _) in zip(instances, scores, strict=True):
        items.setdefault(instance.doc_id, []).append((logprob, len(instance.args[1]), instance))
    acc = norm = 0
    for choices in items.values():
        gold = int(choices[0][2].doc["label"])
        acc += max(range(len(choices)), key=lambda i: choices[i][0]) == gold
        norm += max(range(len(choices)), key=lambda i: choices[i][0] / choices[i][1]) == gold
    return acc / len(items), norm / len(items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--backends", default="kvlab:8,kvlab:auto,hf:8")
    parser.add_argument("--warmup", type=int, default=16)
    args = parser.parse_args()
    _, instances = requests(args.items)
    env = environment()
    print(f"CPU: {env['cpu']} ({env['cpu_capability']}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {TASK}: {args.items} items, "
          f"{len(instances)} requests")  # fmt: skip
    print("| backend | batch_size | loglik/s | seconds | acc | acc_norm | max diff vs hf |")
    print("|---|---|---:|---:|---:|---:|---:|")
    reference = None
    for spec in args.backends.split(","):
        name, batch_size = spec.split(":")
        lm = backend(name, batch_size)
        lm.loglikelihood(instances[: args.warmup], disable_tqdm=True)
        start = time.perf_counter()
        scores = lm.loglikelihood(instances, disable_tqdm=True)
        seconds = time.perf_counter() - start
        if reference is None and name == "hf":
            reference = scores
        diff = (
            f"{max(abs(a[0] - b[0]) for a, b in zip(scores, reference, strict=True)):.1e}"
            if reference is not None
            else "-"
        )
        acc, norm = accuracy(instances, scores)
        rate = len(instances) / seconds
        print(f"| {name} | {batch_size} | {rate:.1f} | {seconds:.1f} | {acc:.4f} | {norm:.4f} "
              f"| {diff} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
