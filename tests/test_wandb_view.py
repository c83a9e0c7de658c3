"""The saved W&B comparison view: it builds and serializes offline (saving needs an account),
and every panel reads a summary metric or config key that kvlab's W&B runs carry."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from kvlab.config import RunConfig
from kvlab.tracking import flatten

pytest.importorskip("wandb_workspaces")
pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning"
)  # pydantic v1 API in wandb-workspaces

# Summary metrics the logger writes for a run with eval=accuracy (names of DESIGN.md).
LOGGED = {"ttft_ms", "itl_ms_p50", "kv_bytes", "weight_bytes", "wikitext2/ppl", "passkey/acc"}


def test_comparison_view_serializes_with_logged_names():
    from kvlab.wandb_view import comparison_view

    view = comparison_view("someone", "kvlab")
    spec = json.loads(view._to_model().model_dump_json())
    assert spec["project"] == "kvlab" and spec["display_name"] == "kvlab comparison"
    config_keys = set(flatten({"config": asdict(RunConfig())}))  # the runs' config keys
    panels = [panel for section in view.sections for panel in section.panels]
    assert len(panels) >= 7
    for panel in panels:
        for axis in ("x", "y"):
            field = getattr(panel, axis, None)
            if field is None:
                continue
            name = getattr(field, "name", field)
            assert name in LOGGED | config_keys, name
    groups = [g.name for g in view.runset_settings.groupby]
    assert groups == ["cache.name", "quant.name"] and set(groups) <= config_keys
