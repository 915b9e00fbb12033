"""The table of ``bench/learner.py``: one row per measured variant, its ratios against the torch
engine and against the same variant padded, and the lines under it."""

from __future__ import annotations

import torch


def peak_flops(arg: float | None) -> float | None:
    if arg:
        return arg * 1e12
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        if "H100" in name or "H200" in name:
            return 989e12
    return None


_FLAGS = ("packing", "checkpointing", "offload", "vision_cache", "proximal", "group_start", "preset")


def _twin(r: dict, rows: list[dict], keys=("engine", "budget"), **changed) -> dict | None:
    """The measured row of ``rows`` with ``r``'s size, log-probs, ``keys`` and flags, but ``changed``."""
    want = {k: r.get(k) for k in ("size", "logprobs", *keys, *_FLAGS)} | changed
    return next((b for b in rows if "seconds" in b and all(b.get(k) == v for k, v in want.items())), None)


def _cells(r: dict, rows: list[dict], peak: float | None) -> str:
    """One measured row of the table."""
    base = _twin(r, rows, keys=("micro_batch_tokens",), engine="torch")
    padded = _twin(r, rows, packing="off")
    ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
    vs_padded = f"{r['tokens_per_s'] / padded['tokens_per_s']:.2f}" if padded else "-"
    mfu = f"{r['flops_per_s'] / peak:.3f}" if peak else "-"
    if r.get("peak_gb") is not None:
        peak_gb = f"{r['peak_gb']:.1f}"
        model = f"{r['model']['total']:.1f}"
    else:
        peak_gb = f"{r['peak_rss_gb']:.2f} RSS (+{r['rss_growth_mb']:,.0f} MB)"
        model = f"{r['model']['total']:.2f} (growth {r['model_growth_mb']:,.0f} MB)"
    how = f"<= {r['micro_batch_tokens']:,} tok" if r["micro_batch_tokens"] else f"{r['micro_batch_size']} rows"
    if r.get("budget") == "auto":
        how = f"auto: {how}"
    lp = r.get("logprobs", "chunked") + (f" ({r['logprob_chunk']})" if r.get("logprobs") != "full" else "")
    cache = "" if r.get("vision_cache", "on") == "on" else " (no vision cache)"
    cache += "" if r.get("proximal", "first") == "first" else " (proximal whole)"
    cache += "" if r.get("group_start", "own") == "own" else " (groups share a start)"
    return (f"| {r['size']} | {r['engine']} | {r.get('packing', 'on')}{cache} | {r.get('checkpointing', 'default')} | "
            f"{r.get('offload', 'none')} | {lp} | {how} | {r['micro_batches']:g} | {r['padding_fraction']:.3f} | "
            f"{r['tokens_per_update']:,} | {r['seconds']:.2f} | {r['cpu_s']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{ratio} | {vs_padded} | {mfu} | {r['forward_s']:.2f} | {r['backward_s']:.2f} | {r['publish_s']:.2f} | "
            f"{peak_gb} | {model} |")


def print_table(rows: list[dict], lengths: str, peak: float | None) -> None:
    print()
    print(f"lengths: {lengths}; pad: the share of computed token slots that are padding; vs torch: against the torch "
          "engine with the same flags; vs padded: against the same variant with --packing off; model GB: the memory "
          "model's prediction (learner/memory.py, GiB) beside the measured peak")
    for preset in sorted({r["preset"] for r in rows if r.get("preset")}):
        print(f"trainer section of preset {preset} (batch sizes, micro-batch budget, epochs, estimator, critic, KL)")
    print("| size | engine | packing | ckpt | offload | log-probs | micro-batches | micro | pad | tokens/update | s/update "
          "| cpu s | tokens/s | vs torch | vs padded | MFU | fwd s | bwd s | publish s | peak GB | model GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "failed" in r or "skipped" in r:
            why = f"failed (exit {r['failed']})" if "failed" in r else r["skipped"]
            print(f"| {r['size']} | {r['engine']} | {r.get('packing', '')} | {r.get('checkpointing', '')} | "
                  f"{r.get('offload', '')} | {r.get('logprobs', '')} | {r['budget']} | {why} ||||||||||||||")
            continue
        print(_cells(r, rows, peak))
    for r in rows:
        if "padding_fraction" in r:
            print(f"padding share of token slots: {r['size']} {r['engine']} packing {r.get('packing')} "
                  f"ckpt {r.get('checkpointing')}: {100 * r['padding_fraction']:.1f} %")
    for r in rows:  # the vision cache's gain: the same variant with --vision-cache off
        off = _twin(r, rows, vision_cache="off")
        if "seconds" in r and r.get("vision_cache", "on") == "on" and off:
            print(f"vision cache: {r['size']} {r['engine']} packing {r.get('packing')}: {r['tokens_per_s']:,.0f} vs "
                  f"{off['tokens_per_s']:,.0f} tokens/s without it: {r['tokens_per_s'] / off['tokens_per_s']:.2f}x")
    for key, base, label in (("proximal", "whole", "the first mini-batch's proximal from its training forward"),
                             ("group_start", "own", "a group's trajectories starting from one observation")):
        for r in rows:  # against the same variant with the baseline value, CPU seconds per update
            other = _twin(r, rows, **{key: base})
            if "seconds" in r and r.get(key, base) != base and other:
                print(f"{label}: {r['size']} {r['engine']} packing {r.get('packing')}: {r['cpu_s']:.2f} vs "
                      f"{other['cpu_s']:.2f} cpu s/update ({key} {base}): {other['cpu_s'] / r['cpu_s']:.2f}x")
    if peak:
        print(f"\nMFU against {peak / 1e12:.0f} TFLOP/s (bf16 dense peak); model FLOPs as in the module docstring.")
