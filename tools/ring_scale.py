"""Plot and tabulate the token ring's model of scale (trainwright/tokenring/scale.py).

    python tools/ring_scale.py            # writes docs/tokenring_scale.png, prints the table

Two gradient sizes: the straggler bench's MLP (1.2 MB) and a 100 M-parameter model (400 MB).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainwright.tokenring.scale import SYSTEMS, ScaleModel, table  # noqa: E402

MODELS = {"bench MLP, 1.2 MB gradient": ScaleModel(),
          "100 M parameters, 400 MB gradient": ScaleModel(grad_bytes=400e6)}
LABELS = {"torch_ddp": "DDP ring all-reduce", "tokenring": "token ring (as built)",
          "tokenring_pipelined_sum": "token ring, pipelined sum (not built)"}


def main() -> None:
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, (name, m) in enumerate(MODELS.items()):
        rows = table(m)
        print(f"\n{name}\n| nodes | straggler | token B | notice B | " + " | ".join(
            f"{s} step s" for s in SYSTEMS) + " | DDP busiest/G | ring busiest/G |")
        print("|" + "---|" * (6 + len(SYSTEMS)))
        for r in rows:
            print(f"| {r['nodes']} | {'one 3x' if r['straggler'] else 'none'} | "
                  f"{r['token_bytes']} | {r['notice_bytes']} | "
                  + " | ".join(f"{r[s + '_step_s']:.3f}" for s in SYSTEMS)
                  + f" | {r['torch_ddp_busiest_bytes_over_grad']:.2f} | "
                    f"{r['tokenring_busiest_bytes_over_grad']:.2f} |")
        for straggler, style in ((False, "-"), (True, "--")):
            sel = [r for r in rows if r["straggler"] == straggler]
            nodes = [r["nodes"] for r in sel]
            for s in SYSTEMS:
                axes[0][col].plot(nodes, [r[f"{s}_step_s"] for r in sel], style, marker="o",
                                  label=f"{LABELS[s]}{', one 3x straggler' if straggler else ''}")
        sel = [r for r in rows if not r["straggler"]]
        for s in ("torch_ddp", "tokenring"):
            axes[1][col].plot([r["nodes"] for r in sel],
                              [r[f"{s}_busiest_bytes_over_grad"] for r in sel], marker="o",
                              label=LABELS[s])
        axes[1][col].axhline(2.5, color="grey", lw=0.8, ls=":", label="target 2.5")
        axes[0][col].set(title=name, xscale="log", yscale="log", ylabel="step time (s)")
        axes[1][col].set(xscale="log", yscale="log", xlabel="nodes",
                         ylabel="busiest node's bytes per step / gradient")
        for ax in axes[:, col]:
            ax.set_xticks([4, 8, 16, 32, 64, 128, 256], labels=[4, 8, 16, 32, 64, 128, 256])
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.suptitle("alpha-beta model (alpha 50 us, 10 Gb/s links, 0.2 s compute): "
                 "trainwright/tokenring/scale.py")
    fig.tight_layout()
    out = Path(__file__).resolve().parents[1] / "docs" / "tokenring_scale.png"
    fig.savefig(out, dpi=90)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
