"""Draw the asset graph of the Dagster definitions into docs/.

    python scripts/asset_graph.py            # writes docs/asset-graph.png and docs/asset-graph.txt
    python scripts/asset_graph.py --check    # exit 1 if docs/asset-graph.txt differs from the definitions

Loads ``vlm_assets.definitions`` (as ``dg dev`` does; no Dagster instance is touched) and reads its
asset graph: every asset, its group, its kinds, its checks and its upstream edges. The PNG shows the
assets as boxes, top to bottom (each below everything it reads), inside a frame per Dagster group. A
solid arrow is an input: the upstream artifact is handed to the step. A dashed one is a ``deps`` edge:
lineage and order only (``visualchat_model`` and ``occlusion_adapter`` read such an upstream by name when
their config names it). ``asset-graph.txt`` holds one ``upstream -> downstream`` edge per line, sorted;
``vlm_assets_tests/test_docs.py`` runs ``--check``, so a changed graph fails the tests until the
picture is drawn again.
"""

import argparse
import dataclasses
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
EDGES_FILE = DOCS / "asset-graph.txt"
PNG_FILE = DOCS / "asset-graph.png"


@dataclasses.dataclass
class Asset:
    name: str
    group: str
    kinds: list[str]
    checks: list[str]
    inputs: list[str]  # upstream assets handed to the step
    deps: list[str]  # upstream assets that are only `deps` edges
    partitioned: bool = False


def load_assets() -> dict[str, Asset]:
    """The assets of the definitions, by name."""
    os.environ.setdefault("VLM_ASSETS_PROFILE", "demo")  # the graph is the same under every profile
    os.environ.pop("DAGSTER_HOME", None)  # loading with a home would check its pool and mend dead runs
    sys.path.insert(0, str(REPO))
    from vlm_assets.definitions import defs

    graph = defs().resolve_asset_graph()
    assets = {}
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        definition = node.assets_def
        inputs, deps = [], []
        for input_name, upstream in definition.keys_by_input_name.items():
            nothing = definition.op.input_def_named(input_name).dagster_type.is_nothing
            (deps if nothing else inputs).append(upstream.to_user_string())
        name = key.to_user_string()
        assets[name] = Asset(
            name=name,
            group=node.group_name or "default",
            kinds=sorted(node.kinds),
            checks=sorted(spec.name for spec in definition.check_specs if spec.asset_key == key),
            inputs=sorted(inputs),
            deps=sorted(deps),
            partitioned=definition.partitions_def is not None,
        )
    return assets


def edges_text(assets: dict[str, Asset]) -> str:
    lines = sorted(f"{up} -> {a.name}" for a in assets.values() for up in (*a.inputs, *a.deps))
    return "".join(f"{line}\n" for line in lines)


def layout(assets: dict[str, Asset]) -> dict[str, tuple[int, float]]:
    """Layer (longest path from a source) and place within the layer of every asset, ordered by group,
    then by the mean place of what the asset reads, so that edges cross as little as they can."""
    column: dict[str, int] = {}

    def col(name: str) -> int:
        if name not in column:
            upstream = [*assets[name].inputs, *assets[name].deps]
            column[name] = 1 + max((col(up) for up in upstream), default=-1)
        return column[name]

    for name in assets:
        col(name)
    groups = sorted(
        {a.group for a in assets.values()}, key=lambda g: min(column[a.name] for a in assets.values() if a.group == g)
    )
    columns: dict[int, list[str]] = {}
    for name in sorted(assets):
        columns.setdefault(column[name], []).append(name)
    row: dict[str, float] = {}
    for c in sorted(columns):
        names = columns[c]

        def mean_upstream(name: str) -> float:
            ups = [row[up] for up in (*assets[name].inputs, *assets[name].deps) if up in row]
            return sum(ups) / len(ups) if ups else 0.0

        names.sort(key=lambda n: (groups.index(assets[n].group), -mean_upstream(n), n))
        if c == 0:
            rows = [float(len(names) - 1 - i) for i in range(len(names))]
        else:  # where their upstream is, on half rows, at least one row apart
            rows = [round(2 * mean_upstream(n)) / 2 for n in names]
            for i in range(1, len(rows)):
                rows[i] = min(rows[i], rows[i - 1] - 1.0)
        row.update(zip(names, rows))
    return {name: (column[name], row[name]) for name in assets}


def draw(assets: dict[str, Asset], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
    from matplotlib.path import Path as Curve

    # Top to bottom, one layer per column of ``layout``: a picture that stays legible at a README's width.
    width, height, x_gap, y_gap = 2.6, 0.95, 3.1, 1.7
    centre = {n: (-r * x_gap, -c * y_gap) for n, (c, r) in layout(assets).items()}

    def box(name: str) -> tuple[float, float, float, float]:
        x, y = centre[name]
        return x - width / 2, y - height / 2, x + width / 2, y + height / 2

    def hits_a_box(points: list[tuple[float, float]], skip: set[str]) -> bool:
        for px, py in points:
            for other in centre:
                x0, y0, x1, y1 = box(other)
                if other not in skip and x0 - 0.1 <= px <= x1 + 0.1 and y0 - 0.1 <= py <= y1 + 0.1:
                    return True
        return False

    # Each edge: a straight line where it passes no other box, else down a lane of its own at the left.
    wall = min(x for x, _ in centre.values()) - width / 2 - 0.45
    edges, lanes = [], 0
    links = [(u, a.name, False) for a in assets.values() for u in a.inputs]
    links += [(u, a.name, True) for a in assets.values() for u in a.deps]
    # the shorter an edge, the nearer its lane: lanes then never cross
    for upstream, name, dashed in sorted(links, key=lambda e: (centre[e[0]][1] - centre[e[1]][1], e)):
        start, end = (centre[upstream][0], box(upstream)[1]), (centre[name][0], box(name)[3])
        line = [(start[0] + (end[0] - start[0]) * t / 40, start[1] + (end[1] - start[1]) * t / 40) for t in range(41)]
        if hits_a_box(line, {upstream, name}):
            lane, lanes = wall - 0.3 * lanes, lanes + 1
            out_y, in_y = centre[upstream][1] - height / 4, centre[name][1] + height / 4
            verts = [(box(upstream)[0], out_y), (lane, out_y), (lane, in_y), (box(name)[0], in_y)]
        else:
            verts = [start, end]
        edges.append((verts, dashed))

    xs, ys = [x for x, _ in centre.values()], [y for _, y in centre.values()]
    left, right = min(xs) - width / 2 - 0.7 - 0.3 * lanes, max(xs) + width / 2 + 0.5
    bottom, top = min(ys) - height / 2 - 1.4, max(ys) + height / 2 + 0.7
    fig, ax = plt.subplots(figsize=(right - left, top - bottom), dpi=130)
    ax.set_xlim(left, right)
    ax.set_ylim(bottom, top)
    ax.set_aspect("equal")
    ax.axis("off")

    fills, borders = ["#e8f1fb", "#eef7ea", "#fdf3e4", "#f4ecf8"], ["#4a7fb5", "#5a9a4a", "#c08a2e", "#8a5aa8"]
    groups = sorted(
        {a.group for a in assets.values()},
        key=lambda g: (-max(centre[a.name][1] for a in assets.values() if a.group == g), g),
    )
    for i, group in enumerate(groups):
        members = [box(a.name) for a in assets.values() if a.group == group]
        x0, y0 = min(b[0] for b in members) - 0.2, min(b[1] for b in members) - 0.15
        x1, y1 = max(b[2] for b in members) + 0.2, max(b[3] for b in members) + 0.42
        fill, border = fills[i % len(fills)], borders[i % len(borders)]
        ax.add_patch(
            FancyBboxPatch(
                (x0, y0),
                x1 - x0,
                y1 - y0,
                boxstyle="round,pad=0,rounding_size=0.2",
                facecolor=fill,
                edgecolor=border,
                linewidth=1.2,
                zorder=0,
            )
        )
        ax.text(x0 + 0.15, y1 - 0.1, f"group: {group}", ha="left", va="top", fontsize=9, color=border, weight="bold")

    for name, (x, y) in centre.items():
        asset = assets[name]
        x0, y0, _, _ = box(name)
        ax.add_patch(
            FancyBboxPatch(
                (x0, y0),
                width,
                height,
                boxstyle="round,pad=0,rounding_size=0.1",
                facecolor="white",
                edgecolor="#333333",
                linewidth=1.2,
                zorder=3,
            )
        )
        checks = len(asset.checks)
        ax.text(x, y + 0.2, name, ha="center", va="center", fontsize=10, weight="bold", zorder=4)
        ax.text(x, y - 0.08, ", ".join(asset.kinds), ha="center", va="center", fontsize=7.5, color="#555555", zorder=4)
        said = f"{checks} blocking check{'s' * (checks != 1)}" if checks else "no checks"
        said = f"partitioned, {said}" if asset.partitioned else said
        ax.text(x, y - 0.3, said, ha="center", va="center", fontsize=7.5, color="#555555", zorder=4)

    def arrow(verts: list[tuple[float, float]], dashed: bool) -> FancyArrowPatch:
        codes = [Curve.MOVETO] + [Curve.LINETO] * (len(verts) - 1)
        return FancyArrowPatch(
            path=Curve(verts, codes),
            arrowstyle="-|>",
            mutation_scale=13,
            linewidth=1.3,
            color="#444444",
            linestyle=(0, (4, 3)) if dashed else "-",
            zorder=2,
        )

    for verts, dashed in edges:
        ax.add_patch(arrow(verts, dashed))
    for i, (dashed, said) in enumerate(
        ((False, "input: the upstream artifact is handed to the step"), (True, "deps: lineage and order only"))
    ):
        legend_y = bottom + 0.8 - 0.4 * i
        ax.add_patch(arrow([(left + 0.3, legend_y), (left + 1.1, legend_y)], dashed))
        ax.text(left + 1.25, legend_y, said, va="center", fontsize=8.5)
    fig.savefig(path, bbox_inches="tight", facecolor="white")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"compare {EDGES_FILE.relative_to(REPO)} with the definitions; write nothing",
    )
    args = parser.parse_args(argv)
    assets = load_assets()
    text = edges_text(assets)
    if args.check:
        written = EDGES_FILE.read_text() if EDGES_FILE.is_file() else ""
        if written != text:
            print(
                f"{EDGES_FILE.relative_to(REPO)} is out of date with the definitions: "
                "run python scripts/asset_graph.py\n"
                f"--- written\n{written}--- definitions\n{text}",
                file=sys.stderr,
            )
            return 1
        print(f"{EDGES_FILE.relative_to(REPO)}: {len(text.splitlines())} edges, current")
        return 0
    DOCS.mkdir(exist_ok=True)
    EDGES_FILE.write_text(text)
    draw(assets, PNG_FILE)
    print(f"wrote {PNG_FILE.relative_to(REPO)} and {EDGES_FILE.relative_to(REPO)} ({len(assets)} assets)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
