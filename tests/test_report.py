"""``kvlab report``: Markdown and plots from result files alone, partial and failed sweeps
included; the sweep as one pandas table."""

from __future__ import annotations

import subprocess
import sys

from kvlab.analysis.report import results_frame, write_report
from kvlab.tracking import write_record


def fake_sweep(root):
    job = 0
    for cache, kv in (("full", 1000), ("int4", 300)):
        for prompt_len in (256, 1024):
            metrics = {
                "ttft_ms": prompt_len / 10,
                "itl_ms_p50": 30.0 + prompt_len / 100,
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


def test_report_renders_tables_plots_and_failures(tmp_path):
    fake_sweep(tmp_path)
    report = write_report(tmp_path).read_text()
    assert "5 points: 4 ok, 1 failed." in report
    assert "ValueError: boom" in report
    for plot in (
        "itl_vs_context.png",
        "ttft_vs_prompt.png",
        "kv_bytes.png",
        "pareto_memory_accuracy.png",
    ):
        assert (tmp_path / plot).stat().st_size > 1000
        assert f"]({plot})" in report


def test_results_frame_has_a_row_per_point(tmp_path):
    fake_sweep(tmp_path)
    frame = results_frame(tmp_path)
    assert len(frame) == 5
    ok = frame[frame["status"] == "ok"]
    kv_bytes = ok.groupby("cache.name")["kv_bytes"].max().to_dict()
    assert kv_bytes == {"full": 1024000, "int4": 307200}
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
