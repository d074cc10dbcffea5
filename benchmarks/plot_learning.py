"""Plot the return curves of `benchmarks/learning.py` runs (JSON lines) into one PNG.

Backs docs/results.md: every learning-curve figure (`docs/figures/*.png` but the dreams and
reconstructions, which `learning.py --dreams-dir` saves).

Usage: python benchmarks/plot_learning.py OUT.png RUN.jsonl [RUN.jsonl ...]
       [--goal 450] [--title "CartPole, 5 seeds"] [--frames-per-step 2]
       [--reference 15000:371 --reference 25000:490 --reference-label "author, S"]

Each run is one line: the mean episode return over env steps, labelled with the file's name
(without the extension). `--frames-per-step` adds a top axis in env frames (DMC: 2 per agent
step); `--reference` marks published points (agent steps:return). Needs matplotlib
(`pip install -e ".[plot]"`).
"""

import argparse
import json
import os


def read_curve(path):
    """`(env_steps, returns)` of the iterations that report a return."""
    steps, returns = [], []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a warning line among the JSON lines
            value = record.get("episode_return_mean")
            if "env_steps" in record and value is not None and value == value:  # not NaN
                steps.append(record["env_steps"])
                returns.append(value)
    return steps, returns


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--goal", type=float, help="draw the target return as a dashed line")
    parser.add_argument("--title", default="")
    parser.add_argument("--frames-per-step", type=float, help="add a top axis in env frames")
    parser.add_argument(
        "--reference", action="append", default=[], help="a published point, STEPS:RETURN"
    )
    parser.add_argument("--reference-label", default="reference")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for path in args.runs:
        ax.plot(*read_curve(path), label=os.path.splitext(os.path.basename(path))[0])
    if args.goal is not None:
        ax.axhline(args.goal, color="gray", linestyle="--", linewidth=1)
    if args.reference:
        points = [tuple(map(float, point.split(":"))) for point in args.reference]
        ax.plot(*zip(*points), "k*", markersize=9, label=args.reference_label)
    ax.set_xlabel("env steps" if args.frames_per_step is None else "agent steps")
    if args.frames_per_step is not None:
        k = args.frames_per_step
        top = ax.secondary_xaxis("top", functions=(lambda x: x * k, lambda x: x / k))
        top.set_xlabel("env frames")
    ax.set_ylabel("mean episode return")
    ax.set_title(args.title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
