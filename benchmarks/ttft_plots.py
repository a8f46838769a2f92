"""The two pictures of a ``benchmarks/ttft.py`` result (``python benchmarks/ttft.py --plot RESULT.json``).

* ``<result>-timeline.png``: one request (the first format, ``--timeline-new`` new tokens, one layer per slice), per
  placement: when each layer's bytes landed and when the engine computed it.
* ``<result>-ttft.png``: first-token time per format, by arm, at concurrency 1 (each size) and at each
  concurrency (mean over the requests).
"""

from __future__ import annotations

import json
import os
from typing import Any


def _best(arms: dict[str, Any], placement: str, stat: str, serial: bool = False) -> tuple[str, float] | None:
    """The fastest fixed layer-major width's arm (``serial``: of those served one request after another)."""
    cands = [(name, a["ttft_ms"][stat]) for name, a in arms.items()
             if name.startswith(placement + "/w") and name.endswith("-serial") == serial]
    return min(cands, key=lambda c: c[1]) if cands else None


def draw(path: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        result = json.load(f)
    stem = os.path.splitext(path)[0]
    written = []
    formats = list(result["formats"])
    placements = result["config"]["placements"]

    timeline_fmt = next((f for f in formats if "timeline" in result["formats"][f]), None)
    if timeline_fmt is not None:
        tl = result["formats"][timeline_fmt]["timeline"]
        fig, axes = plt.subplots(1, len(tl), figsize=(5 * len(tl), 5), sharey=True)
        axes = axes if len(tl) > 1 else [axes]
        for ax, (name, run) in zip(axes, tl.items()):
            t = run["timeline"]
            layers = range(len(t["computed"]))
            for layer in layers:
                ax.plot([t["usable"][layer], t["computed"][layer]], [layer, layer], color="tab:blue", lw=3,
                        label="computed" if layer == 0 else None)
            if t["arrived"]:
                ax.scatter(t["arrived"], range(len(t["arrived"])), s=10, color="tab:orange", zorder=3,
                           label="bytes landed")
            ax.set_title(f"{name}: first token {run['ttft_ms'][0]:.1f} ms")
            ax.set_xlabel("ms since the request was handed over")
            ax.legend(loc="lower right")
        axes[0].set_ylabel("layer")
        fig.suptitle(f"{timeline_fmt}: one request, {result['config'].get('timeline_new_tokens', 1024):,} new tokens, "
                     "one layer per slice")
        fig.tight_layout()
        out = stem + "-timeline.png"
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)

    fig, axes = plt.subplots(len(formats), 1, figsize=(13, 4.2 * len(formats)), squeeze=False)
    for ax, fmt in zip(axes[:, 0], formats):
        fres = result["formats"][fmt]
        groups = [(f"c=1, {n} new", arms, "median") for n, arms in fres.get("concurrency_1", {}).items()]
        groups += [(f"c={c}, {result['config']['concurrency_new_tokens']} new", arms, "mean")
                   for c, arms in fres.get("concurrency", {}).items()]
        series = ["resident"]
        for pl in placements:  # the arms a run has only where asked for (--chunk-major-together, --serial-widths)
            series.append(f"{pl}/chunk")
            if any(f"{pl}/chunk-together" in arms for _, arms, _ in groups):
                series.append(f"{pl}/chunk-together")
            series.append(f"{pl}/best")
            if any(_best(arms, pl, stat, serial=True) for _, arms, stat in groups):
                series.append(f"{pl}/best-serial")
        width = 0.8 / len(series)
        for si, sname in enumerate(series):
            xs, ys, labels = [], [], []
            for gi, (_, arms, stat) in enumerate(groups):
                if "/best" in sname:
                    best = _best(arms, sname.split("/")[0], stat, serial=sname.endswith("-serial"))
                    if best is None:
                        continue
                    label, value = best
                else:
                    if sname not in arms:
                        continue
                    label, value = sname, arms[sname]["ttft_ms"][stat]
                xs.append(gi + (si - len(series) / 2) * width + width / 2)
                ys.append(value)
                labels.append(label.split("/")[-1])
            bars = ax.bar(xs, ys, width, label=sname.replace("best", "best width"))
            if "/best" in sname:
                for bar, lab in zip(bars, labels):
                    ax.annotate(lab, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                                va="bottom", fontsize=6)
        ax.set_xticks(range(len(groups)), [g[0] for g in groups])
        ax.set_ylabel("first-token time, ms (c=1 median, c>1 mean)")
        ax.set_title(fmt)
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    out = stem + "-ttft.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    written.append(out)
    return written
