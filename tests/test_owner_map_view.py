"""The owner map view's model state (no browser): bars, matrix, the panel of a
clicked worker, the matplotlib plot, bounds and determinism."""

from __future__ import annotations

import gc
import random
import time

import pytest
from conftest import poll_for

pytest.importorskip("anywidget")

from nbrpc import debug  # noqa: E402
from nbrpc.jupyter.owner_map_view import (  # noqa: E402
    MAX_WORKERS,
    OWNER_ONLY,
    OwnerMapView,
    matrix,
    owner_map_html,
    owner_map_text,
    plot_owner_map,
    split_bytes,
)
from nbrpc.rref import remote  # noqa: E402


def zeros(n: int):
    import torch

    return torch.zeros(n)


def keep(rref, seconds: float) -> int:
    time.sleep(seconds)  # deliberate: holds the fork of ``rref`` for ``seconds``
    return 1


def test_what_each_worker_owns_and_who_holds_it(trio_default) -> None:
    a, b, c = trio_default
    big = remote(a, "b", zeros, (1024,), {}, -1)  # 4 KiB on b
    small = remote(a, "c", zeros, (16,), {}, -1)  # 64 B on c
    assert poll_for(big.confirmed_by_owner) and poll_for(small.confirmed_by_owner)
    busy = a.rpc_async("c", keep, (big, 0.6))  # c holds a fork of big meanwhile
    rid = str(big._id)
    assert poll_for(lambda: len(debug.owner_map()["b"][0]["held_by"]) == 2)
    view = debug.owner_map().widget()  # the core object finds its view
    assert isinstance(view, OwnerMapView)
    assert view.text() == ("Owner map: 2 values, 4.1 KiB on 3 workers\n"
                           "  a: owns 0 values, 0 B\n"
                           "  b: owns 1 value, 4.0 KiB; held by a: 1 (4.0 KiB), c: 1 (4.0 KiB)\n"
                           "  c: owns 1 value, 64 B; held by a: 1 (64 B)")
    assert split_bytes(view.omap)["b"] == {"a": 2048.0, "c": 2048.0}  # shared by its holders
    assert matrix(view.omap)[("b", "c")] == (1, 4096)
    assert view.html.count('class="nbrpc-owner"') == 3
    view._on_front_end(view, {"event": "select", "key": "worker:b"}, None)
    assert f"<td>{rid}</td><td>torch.Tensor</td><td>4.0 KiB</td><td>a, c</td>" in view.panel
    assert busy.wait() == 1
    del big, small, busy
    gc.collect()
    assert poll_for(lambda: (view.refresh(), view.text())[1].startswith("Owner map: 0 values"))
    assert "b owns 0 values" in view.panel  # the selection follows the refresh
    view._on_front_end(view, {"event": "select", "key": "worker:nobody"}, None)
    assert "KeyError" in view.panel and "known: a, b, c" in view.panel
    view.close()


def synthetic(workers: int, values: int, seed: int) -> dict:
    rng = random.Random(seed)
    names = ["driver"] + [f"worker{i}" for i in range(1, workers)]
    omap: dict = {n: [] for n in names}
    for i in range(values):
        owner = names[1 + i % (workers - 1)]
        held = sorted(set(rng.sample(names, rng.randint(0, 3))) - {owner})
        omap[owner].append({"rref_id": f"0:{i}", "type": "torch.Tensor",
                            "nbytes": rng.randint(1, 10**6), "state": "ready",
                            "held_by": held, "owner_refs": 0, "site": "cell In[2], line 1"})
    return omap


def test_the_plot_stacks_bytes_by_holder_and_the_total_is_bytes_owned() -> None:
    omap = synthetic(4, 40, seed=1)
    fig = plot_owner_map(omap)
    ax = fig.axes[0]
    totals: dict[float, float] = {}
    for bar in ax.patches:
        totals[round(bar.get_y(), 3)] = totals.get(round(bar.get_y(), 3), 0) + bar.get_width()
    owned = [sum(r["nbytes"] for r in omap[w]) for w in omap]
    assert sorted(round(t) for t in totals.values() if t) == sorted(o for o in owned if o)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert OWNER_ONLY in labels and "driver" in labels


def test_sixteen_workers_and_two_thousand_rrefs_stay_bounded() -> None:
    omap = synthetic(16, 2000, seed=2)
    t0 = time.perf_counter()
    view = OwnerMapView(omap)
    took = time.perf_counter() - t0
    print(f"\nowner map, 16 workers x 2,000 RRefs: {len(view.html):,} chars, "
          f"Python render {took * 1e3:.0f} ms")
    assert view.html.count('class="nbrpc-owner"') == 16 and len(view.html) < 200_000
    view.on_select("worker:worker3")
    assert "… and" not in view.panel and view.panel.count("<tr>") == len(omap["worker3"]) + 1
    view.close()
    many = {f"w{i}": [] for i in range(MAX_WORKERS + 5)}
    assert "… and 5 more workers" in owner_map_html(many)


def test_text_and_html_do_not_depend_on_insertion_order() -> None:
    omap = synthetic(5, 60, seed=3)
    shuffled = {w: [dict(r, held_by=sorted(r["held_by"])) for r in reversed(rows)]
                for w, rows in omap.items()}
    assert owner_map_text(omap) == owner_map_text(shuffled)
    assert owner_map_html(omap) == owner_map_html(shuffled)


def test_its_text_follows_the_theme_and_counts_read_on_their_cells() -> None:
    import re

    from nbrpc.jupyter.owner_map_view import CELL_SHADE, owner_map_svg

    omap = {"driver": [], "worker1": [
        {"rref_id": f"1:{i}", "type": "torch.Tensor", "nbytes": 4096 * (i + 1),
         "state": "ready", "held_by": ["driver"], "owner_refs": 0, "site": "x.py:3"}
        for i in range(3)]}
    svg = owner_map_svg(omap)
    # headings, column names, counts and the legend take the page's text colour
    assert re.match(r'<svg [^>]*fill="currentColor"', svg)
    texts = re.findall(r"<text [^>]*>", svg)
    assert len(texts) >= 8 and not [t for t in texts if 'fill="#' in t], texts
    assert not re.search(r'font-size="(9|10)"', svg)  # 11 px, the SVG's own size
    # the cells' blue stays light enough for that text: at most CELL_SHADE's top
    shades = [float(x) for x in re.findall(r'fill="#0072B2" fill-opacity="([\d.]+)"', svg)
              if float(x) > 0.05]
    assert shades and max(shades) == CELL_SHADE[1]
    assert 'fill="#000000"' not in svg  # no black bar, invisible on a dark background


def test_a_wide_matrix_keeps_its_column_names_apart() -> None:
    import re

    from nbrpc.jupyter.owner_map_view import owner_map_svg

    names = ["driver"] + [f"worker{i}" for i in range(1, 16)]
    omap = {n: [] for n in names}
    svg = owner_map_svg(omap)
    heads = re.findall(r'text-anchor="middle">([^<]*)<title>([^<]*)</title>', svg)
    assert [full for _, full in heads] == names
    assert len({shown for shown, _ in heads}) == 16, heads  # cut in the middle, not the end


@pytest.mark.parametrize("workers", [3, 10, 16, 33, 48, 64])
def test_the_map_fits_a_notebook_column_up_to_sixty_four_workers(workers: int) -> None:
    """Side by side while bars and matrix fit 900 px together; else the
    matrix goes under the bars, its rows as clickable as theirs; past 36
    holders its cells show their counts on hover only, under upright names."""
    import re

    from nbrpc.jupyter.owner_map_view import PAGE_W, owner_map_svg

    omap = synthetic(workers, 20 * workers, seed=4)
    svg = owner_map_svg(omap)
    width = float(re.match(r'<svg [^>]*width="([\d.]+)"', svg).group(1))
    assert width <= PAGE_W, f"{workers} workers: {width} px"
    heading = re.search(r'<text x="(\d+)" y="(\d+)" font-weight="bold">values held', svg)
    stacked = int(heading.group(2)) > 14
    assert stacked == (workers > 10), heading.group(0)
    cells = re.findall(r'<g class="nbrpc-owner-cells" data-key="worker:([^"]+)"', svg)
    assert cells == (list(omap) if stacked else [])
    heads = re.findall(r'text-anchor="middle">([^<]*)<title>([^<]*)</title>', svg)
    shown = [s for s, full in heads if full != "driver"]
    assert all(s.startswith("worker") for s in shown) or all(
        re.fullmatch(r"w\d+", s) for s in shown), shown  # one form, not worker9 then w10
    upright = re.findall(r'<text [^>]*transform="rotate\(-90[^>]*>([^<]*)<title>', svg)
    counts = re.findall(r'<text x="[\d.]+" y="\d+" text-anchor="middle">\d+</text>', svg)
    if workers > 36:
        assert len(upright) == workers and not heads and not counts, (upright[:3], counts[:3])
        assert "; counts on hover" in svg
        assert all(re.fullmatch(r"w\d+|d…er", s) for s in upright), upright
    else:
        assert not upright and len(heads) == workers and counts
