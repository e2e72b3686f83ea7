"""Experiment logging: what a real run writes to TensorBoard, wandb (offline) and MLflow is what metrics_df() shows.

Nothing here fakes a logging library: each backend writes its own files under tmp_path
and the test reads them back with that library's own reader (TensorBoard's
EventAccumulator, wandb's Record protobuf, MlflowClient).
"""

from __future__ import annotations

import json
import math
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lightning_nb import AlgorithmConfig, GRPOConfig, GRPOTrainer, LightningRL, start_runners
from lightning_nb.errors import ConfigError, LightningNbError, MissingDependencyError
from lightning_nb.loggers import (MetricLogger, MLflowLogger, TensorBoardLogger, WandbLogger, make_loggers, mlflow_name,
                                  split_values)


# ----- readers: each backend's files, read back through its own library ---------------------------------
def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return {tag: {e.step: e.value for e in ea.Scalars(tag)} for tag in ea.Tags()["scalars"]}


def tensorboard_texts(log_dir: Path) -> dict[str, dict[int, str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    ea = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    ea.Reload()
    return {tag.removesuffix("/text_summary"): {e.step: tensor_util.make_ndarray(e.tensor_proto).item().decode()
                                                for e in ea.Tensors(tag)} for tag in ea.Tags()["tensors"]}


def wandb_records(run_file: Path) -> list:
    """The records of an offline run's ``.wandb`` file, parsed with wandb's own ``Record`` protobuf.

    wandb 0.31 has no Python reader left (wandb-core, in Go, writes and syncs the file); the
    framing is LevelDB's log format after a 7-byte ``:W&B`` header: 32 KiB blocks of chunks,
    each with a 7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last).
    """
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos: pos + 7])
        if kind == 0 and length == 0:  # zero padding up to the next block
            pos += left
            continue
        chunk = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def wandb_history(run_dir: Path) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, str]], list]:
    """(scalars, texts, exit records) of the offline run under ``run_dir`` (one run expected)."""
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    scalars: dict[str, dict[int, float]] = {}
    texts: dict[str, dict[int, str]] = {}
    exits = []
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "exit":
            exits.append(record.exit)
        if kind != "history":
            continue
        item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
        step = item["step"]
        for key, value in item.items():
            if key.startswith("_") or key == "step":
                continue
            if isinstance(value, str):
                texts.setdefault(key, {})[step] = value
            else:
                scalars.setdefault(key, {})[step] = float("nan") if value in ("NaN", None) else float(value)
    return scalars, texts, exits


def mlflow_run(tracking_uri: str, run_id: str) -> tuple[dict[str, dict[int, float]], dict, object]:
    """(scalars by metric and step, tags, run info) of an MLflow run, read with MlflowClient."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    scalars = {key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in run.data.metrics}
    return scalars, run.data, run.info


def expected_scalars(df) -> dict[str, dict[int, float]]:
    """metrics_df() as {column: {step: value}} for its numeric cells (NaN cells: a column absent from that row)."""
    out: dict[str, dict[int, float]] = {}
    for col in df.columns:
        if col == "step" or not pd.api.types.is_numeric_dtype(df[col]):
            continue
        for step, value in zip(df["step"], df[col]):
            if not math.isnan(value):
                out.setdefault(col, {})[int(step)] = float(value)
    return out


def assert_same(got: dict[str, dict[int, float]], want: dict[str, dict[int, float]], rel: float = 0.0) -> None:
    got = {k: {s: v for s, v in by_step.items() if not math.isnan(v)} for k, by_step in got.items()}
    got = {k: v for k, v in got.items() if v}
    assert set(got) == set(want), (sorted(set(got) ^ set(want)))
    for key in want:
        assert set(got[key]) == set(want[key]), key
        for step, value in want[key].items():
            if rel:  # TensorBoard stores scalars as float32
                assert got[key][step] == pytest.approx(value, rel=rel, abs=1e-30), (key, step)
            else:
                assert got[key][step] == value, (key, step, got[key][step], value)


# ----- fast: no model ------------------------------------------------------------------------------------
def test_split_values_keeps_numbers_and_non_empty_text_and_skips_the_rest():
    row = {"step": 3, "loss": 0.5, "episodes": np.int64(4), "ok": True, "kl": math.nan, "lr": np.float32(1e-5),
           "config_changes": "lr 1 → 2", "empty": "", "none": None, "nested": {"a": 1}}
    scalars, texts = split_values(row)
    assert set(scalars) == {"loss", "episodes", "ok", "kl", "lr"} and all(type(v) is float for v in scalars.values())
    assert scalars["episodes"] == 4.0 and scalars["ok"] == 1.0 and math.isnan(scalars["kl"])
    assert texts == {"config_changes": "lr 1 → 2"}


def test_shorthands_build_default_loggers_and_others_are_refused(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    tb, wb, ml = make_loggers(["tensorboard", "wandb", "MLflow"], config={"trainer.learning_rate": 2e-5})
    assert (type(tb), type(wb), type(ml)) == (TensorBoardLogger, WandbLogger, MLflowLogger)
    assert wb.mode == "offline" and ml.config == {"trainer.learning_rate": 2e-5}
    assert not any(lg.is_open for lg in (tb, wb, ml))  # nothing is written before the first row
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert WandbLogger().mode is None  # wandb reads WANDB_MODE itself
    assert WandbLogger(mode="online").mode == "online"
    with pytest.raises(ConfigError, match="comet"):
        make_loggers(["comet"])
    with pytest.raises(ConfigError, match="must be a list"):
        make_loggers("tensorboard")
    with pytest.raises(ConfigError, match="status"):
        tb.close("done")


@pytest.mark.parametrize("cls, module, extra", [(MLflowLogger, "mlflow", "mlflow"), (WandbLogger, "wandb", "wandb"),
                                                (TensorBoardLogger, "tensorboard", "tensorboard")])
def test_a_missing_package_raises_import_error_naming_the_extra(monkeypatch, cls, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # `import <module>` now raises ImportError
    with pytest.raises(ImportError, match=rf"lightning-nb\[{extra}\]") as info:
        cls()
    assert isinstance(info.value, MissingDependencyError)
    with pytest.raises(MissingDependencyError):
        make_loggers([module])


def test_rows_and_late_values_reach_each_backend_through_the_logger_contract(tmp_path, monkeypatch):
    """The contract alone (no model): rows, a value added to a logged row, and one for a row not logged yet."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.chdir(tmp_path)  # anything written to the working directory by mistake stays here
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tb, wb, ml = TensorBoardLogger(tmp_path / "tb"), WandbLogger(dir=tmp_path / "wb"), MLflowLogger(uri)
    rows = [{"step": 1, "loss": 0.25, "reward_mean": 0.5, "config_changes": ""},
            {"step": 2, "loss": -0.125, "reward_mean": 0.75, "config_changes": "learning_rate 2e-05 → 1e-05"}]
    for logger in (tb, wb, ml):
        for row in rows:
            logger.log_row(row)
        logger.log_added(2, {"val_reward": 0.625, "val_reward/ops=2": 0.125})  # a per-slice column
        logger.log_added(3, {"val_reward": 1.0})  # step 3 was never logged: goes out with its row, not now
        logger.close()
        logger.close()  # twice is a no-op
    want = {"loss": {1: 0.25, 2: -0.125}, "reward_mean": {1: 0.5, 2: 0.75}, "val_reward": {2: 0.625},
            "val_reward/ops=2": {2: 0.125}}
    assert_same(tensorboard_scalars(tmp_path / "tb"), want)
    assert tensorboard_texts(tmp_path / "tb") == {"config_changes": {2: "learning_rate 2e-05 → 1e-05"}}
    scalars, texts, exits = wandb_history(tmp_path / "wb")
    assert_same(scalars, want)
    assert texts == {"config_changes": {2: "learning_rate 2e-05 → 1e-05"}} and [e.exit_code for e in exits] == [0]
    scalars, data, info = mlflow_run(uri, ml.run_id)
    assert_same(scalars, {mlflow_name(k): v for k, v in want.items()})  # MLflow refuses "=": ops:2
    assert "val_reward/ops:2" in scalars and data.tags["config_changes/step_2"] == "learning_rate 2e-05 → 1e-05" and info.status == "FINISHED"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db", "tb", "wb"]


def test_a_value_added_after_close_opens_the_same_run_again(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tb, wb, ml = TensorBoardLogger(tmp_path / "tb"), WandbLogger(dir=tmp_path / "wb"), MLflowLogger(uri)
    for logger in (tb, wb, ml):
        logger.log_row({"step": 1, "loss": 0.5})
        logger.close("stopped")
        logger.log_added(1, {"val_reward": 0.25})  # e.g. an evaluation after the trainer was stopped
        assert logger.is_open
        logger.close()
    want = {"loss": {1: 0.5}, "val_reward": {1: 0.25}}
    assert_same(tensorboard_scalars(tmp_path / "tb"), want)  # two event files in the one folder
    scalars, _, info = mlflow_run(uri, ml.run_id)
    assert_same(scalars, want)
    assert info.status == "FINISHED"
    files = sorted((tmp_path / "wb").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2 and {f.name for f in files} == {f"run-{wb.run_id}.wandb"}  # resumed: the same run id
    history = [json.loads(i.value_json) for f in files for r in wandb_records(f) if r.HasField("history")
               for i in r.history.item if (i.key or "/".join(i.nested_key)) in ("loss", "val_reward")]
    assert history == [0.5, 0.25]


# ----- slow: the real model, real LightningRL runs -------------------------------------------------------
def _three_loggers(tmp_path: Path) -> tuple[list[MetricLogger], str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return [TensorBoardLogger(tmp_path / "tb"), WandbLogger(dir=tmp_path / "wb"), MLflowLogger(uri)], uri


def _wait_for_step(algo: LightningRL, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while algo.global_step < step:
        assert time.monotonic() < deadline and algo.state != "failed", (algo.state, algo.error)
        time.sleep(0.2)


def _logged_algo(engine, store, tmp_path: Path) -> tuple[GRPOTrainer, LightningRL, list[MetricLogger], str]:
    """A trainer and a one-task LightningRL (groups of 2, 4 tokens) logging to the three backends under tmp_path."""
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    loggers, uri = _three_loggers(tmp_path)
    algo = LightningRL(store, trainer, [{"id": "t"}], config=AlgorithmConfig(
        tasks_per_step=1, group_size=2, max_tokens=4, max_sample_rounds=1), loggers=loggers)
    return trainer, algo, loggers, uri


@pytest.mark.slow
def test_a_real_run_logs_what_metrics_df_shows_to_every_backend(engine, pristine, proxied_store, agent_with_reward,
                                                                tmp_path, monkeypatch):
    """Two run() calls (a config edit between them), a val_reward added afterwards, then close_loggers()."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.chdir(tmp_path)
    store = proxied_store
    runners = start_runners(agent_with_reward([0.0, 1.0]), store, n=2)
    trainer, algo, loggers, uri = _logged_algo(engine, store, tmp_path)
    try:
        algo.start(steps=1)
        assert algo.wait(timeout=300) and algo.state == "finished"
        assert all(lg.is_open for lg in loggers)  # flushed, not closed: the next start() is the same logged run
        trainer.config.learning_rate = 1e-5
        algo.start(steps=1)
        assert algo.wait(timeout=300) and algo.global_step == 2
        val = algo.evaluate([{"id": "v1"}, {"id": "v2"}], progress=False)
        algo.add_metrics(algo.global_step, val_reward=val)
        algo.close_loggers()
    finally:
        algo.stop(timeout=60)
        runners.stop()
    df = algo.metrics_df()
    assert df["step"].tolist() == [1, 2] and df["val_reward"].tolist()[1] == val
    changes = {2: "learning_rate 2e-05 → 1e-05"}
    assert df["config_changes"].tolist() == ["", changes[2]]
    want = expected_scalars(df)
    assert {"loss", "reward_mean", "grad_norm", "lr", "step_seconds", "val_reward"} <= set(want)

    assert_same(tensorboard_scalars(tmp_path / "tb"), want, rel=1e-6)
    texts = tensorboard_texts(tmp_path / "tb")
    assert texts["config_changes"] == changes and '"trainer.learning_rate": 2e-05' in texts["config"][0]

    scalars, texts, exits = wandb_history(tmp_path / "wb")
    assert_same(scalars, want)
    assert texts == {"config_changes": changes} and [e.exit_code for e in exits] == [0]

    scalars, data, info = mlflow_run(uri, loggers[2].run_id)
    assert_same(scalars, want)
    assert data.tags["config_changes/step_2"] == changes[2] and "config_changes/step_1" not in data.tags
    assert data.params["trainer.learning_rate"] == "2e-05" and data.params["algorithm.group_size"] == "2"
    assert info.status == "FINISHED"


@pytest.mark.slow
def test_stopping_the_trainer_closes_the_loggers_with_what_was_logged(engine, pristine, proxied_store,
                                                                      agent_with_reward, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.chdir(tmp_path)
    store = proxied_store
    runners = start_runners(agent_with_reward([0.0, 1.0]), store, n=2)
    trainer, algo, loggers, uri = _logged_algo(engine, store, tmp_path)
    try:
        algo.start(steps=100)
        _wait_for_step(algo, 1)
        assert algo.stop(timeout=300) and algo.state == "stopped"
    finally:
        algo.stop(timeout=60)
        runners.stop()
    assert not any(lg.is_open for lg in loggers)
    want = expected_scalars(algo.metrics_df())
    assert want["loss"] and set(want["loss"]) == set(range(1, algo.global_step + 1))
    assert_same(tensorboard_scalars(tmp_path / "tb"), want, rel=1e-6)
    scalars, _, exits = wandb_history(tmp_path / "wb")
    assert_same(scalars, want)
    assert [e.exit_code for e in exits] == [0]
    scalars, _, info = mlflow_run(uri, loggers[2].run_id)
    assert_same(scalars, want)
    assert info.status == "KILLED"


def _no_llm_agent(task, llm):
    return 1.0  # no LLM call: the adapter finds no triplets and the step fails


@pytest.mark.slow
def test_a_failed_loop_closes_the_loggers_as_failed(engine, proxied_store, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.chdir(tmp_path)
    store = proxied_store
    runners = start_runners(_no_llm_agent, store, n=2)
    trainer = GRPOTrainer(engine, GRPOConfig(track_reference_kl=False))
    loggers, uri = _three_loggers(tmp_path)
    algo = LightningRL(store, trainer, [{"id": "t"}], config=AlgorithmConfig(
        tasks_per_step=1, group_size=2, max_sample_rounds=1), loggers=loggers)
    try:
        for lg in loggers:  # a row logged before the failure, so every run is open when the loop fails
            lg.log_row({"step": 0, "probe": 1.0})
        algo.start(steps=1)
        with pytest.raises(LightningNbError, match="no triplets"):
            algo.wait(timeout=300)
    finally:
        algo.stop(timeout=60)
        runners.stop()
    assert algo.state == "failed" and not any(lg.is_open for lg in loggers)
    _, _, exits = wandb_history(tmp_path / "wb")
    assert [e.exit_code for e in exits] == [1]
    scalars, _, info = mlflow_run(uri, loggers[2].run_id)
    assert scalars == {"probe": {0: 1.0}} and info.status == "FAILED"
    assert tensorboard_scalars(tmp_path / "tb") == {"probe": {0: 1.0}}


def test_the_demo_cli_puts_its_loggers_under_out(tmp_path, monkeypatch):
    from lightning_nb.cli import main
    from lightning_nb.cli.demo import _demo_loggers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tb, ml, wb = _demo_loggers(["tensorboard", "mlflow", "tensorboard", "wandb"], tmp_path)  # repeats count once
    assert (type(tb), type(ml), type(wb)) == (TensorBoardLogger, MLflowLogger, WandbLogger)
    assert tb.log_dir == str(tmp_path / "tensorboard") and wb.dir == str(tmp_path)
    assert ml.tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    with pytest.raises(SystemExit):
        main(["demo", "--logger", "comet"])
