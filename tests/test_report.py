"""``kvlab report``: Markdown and plots from result files alone, partial and failed sweeps
included; the sweep as one pandas table."""

from __future__ import annotations

import json
import subprocess
import sys

from kvlab.analysis.report import results_frame, write_report
from kvlab.tracking import write_record


def fake_sweep(root):
    """full, int4 and nocache at two prompt lengths (int4 at 0.3x full's bytes), one failed
    point; nocache holds no KV and decodes far slower than the rest."""
    job = 0
    for cache, kv, itl in (("full", 1000, 30.0), ("int4", 300, 28.0), ("nocache", 0, 900.0)):
        for prompt_len in (256, 1024):
            metrics = {
                "ttft_ms": prompt_len / 10,
                "itl_ms_p50": itl + prompt_len / 100,
                "kv_bytes": kv * prompt_len,
                "wikitext2/ppl": 20.0 + (cache == "int4"),
            }
            config = {
                "cache": {"name": cache, "options": {}},
                "workload": {"prompt_len": prompt_len},
            }
            write_record(root / f"{job}_x", {"config": config, "status": "ok", "metrics": metrics})
            job += 1
    write_record(
        root / f"{job}_bad",
        {"config": {"cache": {"name": "sliding"}}, "status": "failed", "error": "ValueError: boom"},
    )


def figure(path):
    """A report PNG opened: its pixel size and the panels it says it draws."""
    from PIL import Image

    with Image.open(path) as image:
        return image.size, json.loads(image.text["kvlab"])


def test_report_renders_tables_plots_and_failures(tmp_path):
    fake_sweep(tmp_path)
    report = write_report(tmp_path).read_text()
    assert "7 points: 6 ok, 1 failed." in report
    assert "ValueError: boom" in report
    assert "| int4 (KIVI int4: keys per channel" in report  # the long description, in the table
    assert "| 300 KiB |" in report  # int4's KV bytes at 1024 tokens, in binary units
    for plot in (
        "accuracy_vs_compression.png",
        "latency_vs_context.png",
        "kv_memory.png",
        "pareto_memory_accuracy.png",
    ):
        assert f"]({plot})" in report
        (width, height), _ = figure(tmp_path / plot)
        assert width >= 500 and height >= 300


def test_report_plots_show_each_strategy_once_with_short_labels_and_units(tmp_path):
    fake_sweep(tmp_path)
    write_report(tmp_path)
    _, [accuracy] = figure(tmp_path / "accuracy_vs_compression.png")
    assert accuracy["xlabel"] == "KV compression ratio vs full (prompt 1024)"
    assert accuracy["series"] == ["full", "int4"]  # nocache holds nothing to compress
    _, [itl, ttft] = figure(tmp_path / "latency_vs_context.png")
    assert (itl["ylabel"], ttft["ylabel"]) == ("ITL p50 (ms)", "TTFT (ms)")
    assert itl["series"] == ttft["series"] == ["full", "int4", "nocache"]
    assert itl["outliers"] == ["nocache"] and ttft["outliers"] == []
    _, [memory] = figure(tmp_path / "kv_memory.png")
    assert memory["ylabel"] == "KV cache (KiB)"
    _, pareto = figure(tmp_path / "pareto_memory_accuracy.png")
    assert [p["title"] for p in pareto] == [
        "Pareto front at prompt 256",
        "Pareto front at prompt 1024",
    ]
    assert all(p["front"] == ["int4", "full"] and p["xlabel"] == "KV cache (KiB)" for p in pareto)


def test_pareto_front_keeps_what_no_point_beats():
    from kvlab.analysis.plots import pareto_front

    points = [(1, 25.0, "a"), (2, 21.0, "b"), (3, 22.0, "c"), (4, 20.0, "d"), (4, 20.5, "e")]
    assert [s for _, _, s in pareto_front(points, higher=False)] == ["a", "b", "d"]
    assert [s for _, _, s in pareto_front(points, higher=True)] == ["a"]


def test_results_frame_has_a_row_per_point(tmp_path):
    fake_sweep(tmp_path)
    frame = results_frame(tmp_path)
    assert len(frame) == 7
    ok = frame[frame["status"] == "ok"]
    kv_bytes = ok.groupby("cache.name")["kv_bytes"].max().to_dict()
    assert kv_bytes == {"full": 1024000, "int4": 307200, "nocache": 0}
    assert frame.loc[frame["status"] == "failed", "error"].tolist() == ["ValueError: boom"]


def test_report_command_prints_where_it_wrote(tmp_path):
    fake_sweep(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "kvlab.cli", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"report: {tmp_path / 'report.md'}" in done.stdout


def test_points_timed_side_by_side_on_one_host_are_marked(tmp_path):
    """Two points whose runs overlapped on one host are marked ``concurrent``; a point on
    another host, or after them, is not (and the column appears only when some are)."""
    from kvlab.tracking import format_table, load_results, table_columns

    spans = {"0_a": ("n1", 0, 10), "1_b": ("n1", 5, 12), "2_c": ("n1", 12, 20), "3_d": ("n2", 0, 9)}
    for name, (host, start, end) in spans.items():
        record = {"config": {"cache": {"name": name}}, "status": "ok", "metrics": {}}
        record |= {"environment": {"hostname": host}, "started_at": start, "ended_at": end}
        write_record(tmp_path / name, record)
    rows = load_results(tmp_path)
    assert [r["concurrent"] for r in rows] == [1, 1, 0, 0]
    assert "concurrent" in format_table(rows, table_columns(rows))
    assert "concurrent" not in table_columns(rows[2:])


def test_the_table_tells_points_of_one_strategy_apart_and_shows_fidelity(tmp_path):
    """A sweep over a strategy's options shows the options that differ within it (not
    every option another strategy has), and eval=kld's metrics with small values visible."""
    from kvlab.tracking import format_table, load_results, table_columns

    points = {
        "0_full": ("full", {"kv_bits": 0, "kv_format": "int"}, 0.0),
        "1_fp8": ("full", {"kv_bits": 8, "kv_format": "e4m3"}, 0.0035),
        "2_comp": ("compressed", {"window": 128, "kv_bits": 0, "kv_format": "int"}, 0.05),
    }
    for name, (cache, options, kld) in points.items():
        metrics = {"wikitext2/kld": kld, "wikitext2/delta_nll": -kld / 3}
        record = {"config": {"cache": {"name": cache, "options": options}}, "status": "ok"}
        write_record(tmp_path / name, record | {"metrics": metrics})
    rows = load_results(tmp_path)
    columns = table_columns(rows)
    assert "cache.options.kv_bits" in columns and "cache.options.kv_format" in columns
    assert "cache.options.window" not in columns  # one compressed point: nothing to tell apart
    assert columns[-2:] == ("wikitext2/delta_nll", "wikitext2/kld")
    table = format_table(rows, columns).splitlines()
    assert "e4m3" in table[2] and "0.0035" in table[2] and "-0.00117" in table[2]
