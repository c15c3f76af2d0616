"""Per-iteration time breakdown and memory trend of a run, from its --metrics-path file.

    .venv/bin/python bench/breakdown.py runs/tiny/grpo/metrics.jsonl
Parts: rollout (generation + rewards), log-probs (actor/ref forward), train steps, weight push, eval, and the rest
(driver, Ray calls, memory probes, checkpoints) = step time minus the parts; then the parts of the rollout, of the
colocated memory swap and of the weight push (perf/rollout/*, perf/offload/*, perf/update_weights/*). Under --async
the rollout part is the time the driver waited for generation (the rest of it ran during the previous rollout's
training).
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    rows = [r for r in rows if r["rollout_id"] >= 0 and "perf/step_time" in r]
    n = len(rows)

    def total(key: str) -> float:
        return sum(r.get(key, 0.0) for r in rows)

    step = total("perf/step_time")
    overlapped = any("perf/async_overlap_time" in r for r in rows)  # --async
    parts = {
        "rollout (waited for)" if overlapped else "rollout":
            total("perf/rollout_wait_time") if overlapped else total("perf/rollout_time"),
        "log-probs (actor + ref)": total("perf/log_probs_time"),
        "train steps": total("perf/train_time") - total("perf/log_probs_time"),
        "weight push": total("perf/update_weights_time"),
        "eval": total("perf/eval_time"),
        "colocate memory swap (release/offload/resume)": total("perf/offload_time"),
    }
    parts["rest (driver, Ray, probes)"] = step - sum(parts.values())
    print(f"{n} iterations, mean step {step / n:.3f} s")
    print("| part | s / iteration | share |")
    print("|---|---|---|")
    for name, value in parts.items():
        print(f"| {name} | {value / n:.3f} | {100 * value / step:.1f}% |")
    if overlapped:
        print(f"--async: generation took {total('perf/rollout_time') / n:.3f} s / iteration, "
              f"{total('perf/async_overlap_time') / n:.3f} s of it during the previous rollout's training")
    prefixes = ("perf/rollout/", "perf/offload/", "perf/update_weights/")
    rollout_parts = sorted({k for r in rows for k in r if k.startswith(prefixes)})
    if rollout_parts:  # slime_lite/rollout/timing.py says what each rollout part is
        print("| rollout / offload / push part (per iteration) | iteration 0 | mean of the rest |")
        print("|---|---|---|")
        for key in rollout_parts:
            rest = [r[key] for r in rows[1:] if key in r]
            print(f"| {key} | {rows[0].get(key, float('nan')):.3f} | "
                  f"{sum(rest) / len(rest) if rest else float('nan'):.3f} |")
    for key in sorted(k for k in rows[0] if k.startswith("perf/memory/") and k.endswith("/rss_mb")):
        first, last = rows[0][key], rows[-1][key]
        print(f"{key}: {first:.0f} MB at iteration 0 -> {last:.0f} MB at iteration {n - 1} "
              f"({100 * (last - first) / first:+.1f}%)")


if __name__ == "__main__":
    main(sys.argv[1])
