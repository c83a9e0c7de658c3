"""The thread count comes from the CPUs a process was given (issue 27): an explicit
``threads=``, then ``OMP_NUM_THREADS``, then SLURM's allotment, then the affinity mask."""

from __future__ import annotations

import os

import pytest
import torch

from kvlab.threads import allotted_threads, apply_threads, threads_source


@pytest.fixture
def clean_env(monkeypatch):
    for variable in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    return monkeypatch


def test_the_allotment_wins_over_the_machine_in_order(clean_env):
    assert allotted_threads() == (3, "affinity")
    clean_env.setenv("SLURM_CPUS_PER_TASK", "1")
    assert allotted_threads() == (1, "SLURM_CPUS_PER_TASK")
    clean_env.setenv("OMP_NUM_THREADS", "2")
    assert allotted_threads() == (2, "OMP_NUM_THREADS")
    assert allotted_threads(5) == (5, "threads=")


def test_empty_or_bad_variables_are_ignored(clean_env):
    clean_env.setenv("SLURM_CPUS_PER_TASK", "")
    clean_env.setenv("OMP_NUM_THREADS", "0")
    assert allotted_threads() == (3, "affinity")


def test_applying_sets_torch_and_the_record(clean_env):
    before = torch.get_num_threads()
    clean_env.setenv("SLURM_CPUS_PER_TASK", "1")
    try:
        assert apply_threads() == (1, "SLURM_CPUS_PER_TASK")
        assert torch.get_num_threads() == 1 and threads_source() == "SLURM_CPUS_PER_TASK"
        from kvlab.tracking import environment

        record = environment()
        assert record["threads"] == 1 and record["threads_source"] == "SLURM_CPUS_PER_TASK"
    finally:
        torch.set_num_threads(before)
