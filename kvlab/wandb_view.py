"""The saved W&B comparison view of a kvlab project (W&B's Workspace API,
``wandb-workspaces``): runs grouped by cache strategy and weight quantizer, panels for
decode (ITL vs KV bytes), prefill (TTFT vs prompt length) and accuracy (perplexity and
passkey vs KV bytes), all from the summary metrics ``kvlab.wandb_logger`` writes."""

from __future__ import annotations

from typing import Any


def comparison_view(entity: str, project: str = "kvlab", name: str = "kvlab comparison") -> Any:
    """The view as a ``wandb_workspaces`` Workspace (not saved: call ``.save()``)."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as exc:
        raise ImportError(
            "the saved view needs wandb-workspaces: pip install -e '.[wandb]'"
        ) from exc

    def scatter(title: str, x: Any, y: str, log_x: bool = False) -> Any:
        return wr.ScatterPlot(title=title, x=x, y=wr.SummaryMetric(y), log_x=log_x)

    kv_bytes = wr.SummaryMetric("kv_bytes")
    sections = {
        "Decode: ITL vs memory": [
            scatter("ITL p50 (ms) vs KV bytes", kv_bytes, "itl_ms_p50", log_x=True),
            wr.BarPlot(title="ITL p50 (ms)", metrics=[wr.SummaryMetric("itl_ms_p50")]),
            wr.BarPlot(title="KV bytes", metrics=[kv_bytes]),
        ],
        "Prefill: TTFT vs prompt length": [
            scatter("TTFT (ms) vs prompt length", wr.Config("workload.prompt_len"), "ttft_ms"),
            scatter(
                "ITL p50 (ms) vs prompt length", wr.Config("workload.prompt_len"), "itl_ms_p50"
            ),
        ],
        "Accuracy vs memory": [
            scatter("WikiText-2 perplexity vs KV bytes", kv_bytes, "wikitext2/ppl", log_x=True),
            scatter("passkey accuracy vs KV bytes", kv_bytes, "passkey/acc", log_x=True),
            scatter(
                "perplexity vs weight bytes", wr.SummaryMetric("weight_bytes"), "wikitext2/ppl"
            ),
        ],
    }
    return ws.Workspace(
        entity=entity,
        project=project,
        name=name,
        sections=[ws.Section(name=n, panels=p, is_open=True) for n, p in sections.items()],
        runset_settings=ws.RunsetSettings(
            groupby=[ws.Config("cache.name"), ws.Config("quant.name")]
        ),
    )


def save_view(entity: str, project: str = "kvlab") -> str:
    """Save the view into ``entity/project`` (needs ``wandb login``); returns its URL."""
    view = comparison_view(entity, project)
    view.save()
    return view.url
