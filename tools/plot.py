"""Draw the curves of one or several runs to a PNG: loss and val loss (online RL: reward), learning rate, tokens/s,
peak memory.

    python tools/plot.py RUN_DIR [RUN_DIR ...] [--out PNG] [--smooth K]

Reads each run's metrics.jsonl (what train.py writes on rank 0); runs share axes and colours, one per run, so two
recipes or two shardings can be compared at a glance. The PNG goes to --out (default: RUN_DIR/metrics.png of the
first run). Needs matplotlib: pip install 'fsdp_trainer[plot]'.
"""

from __future__ import annotations

import json
from pathlib import Path

from jsonargparse import ArgumentParser

from fsdp_trainer.config import one_line_errors
from fsdp_trainer.files import METRICS_FILE

PANELS = [  # (metrics.jsonl key, title)
    ("loss", "loss (train solid, val dashed)"),
    ("lr", "learning rate"),
    ("tokens_per_s", "tokens/s (all ranks)"),
    ("peak_mem_gb", "peak memory per rank (GB)"),
]


def read_run(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass the train.out_dir of a run")
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def moving_average(values: list[float], k: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - k] if i >= k else 0.0)
        out.append(total / min(i + 1, k))
    return out


def plot(runs: dict[str, list[dict]], out: Path, smooth: int = 1) -> dict[tuple[str, str], tuple[list, list]]:
    """Draw and save; returns what was drawn, {(run, key): (steps, values)}."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    drawn = {}
    panels = PANELS
    if any("reward" in r for records in runs.values() for r in records):  # online RL: the reward says how it goes
        panels = [("reward", "reward (train solid, val dashed)"), *PANELS[1:]]
    for (key, title), ax in zip(panels, axes.flat, strict=True):
        for i, (name, records) in enumerate(runs.items()):
            colour = f"C{i}"
            steps, values = series(records, key)
            if key in ("loss", "reward") and smooth > 1:
                values = moving_average(values, smooth)
            ax.plot(steps, values, color=colour, label=name)
            drawn[name, key] = steps, values
            if key in ("loss", "reward"):
                val_steps, val = series(records, f"val_{key}")
                ax.plot(val_steps, val, color=colour, linestyle="--", marker="o", markersize=3)
                drawn[name, f"val_{key}"] = val_steps, val
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="tools/plot.py", description=__doc__.split("\n\n")[0], exit_on_error=False)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (train.out_dir)")
    parser.add_argument("--out", type=Path | None, help="PNG to write (default: FIRST_RUN/metrics.png)")
    parser.add_argument("--smooth", type=int, default=1, help="moving average over this many logged train losses")
    with one_line_errors():
        args = parser.parse_args(argv)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ImportError("tools/plot.py needs matplotlib: pip install 'fsdp_trainer[plot]'") from None
        runs = {str(run): read_run(run) for run in args.runs}
        out = args.out or args.runs[0] / "metrics.png"
        plot(runs, out, args.smooth)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
