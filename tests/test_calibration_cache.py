"""Calibrations kept between starts (engine/calibration_cache.py): a second engine on the same
machine, model, settings and code takes the first one's step times and states the same
promise without timing a step; anything else measures anew."""

from __future__ import annotations

import asyncio
import json
import time

from expresslane import LLM, SamplingParams
from expresslane.config import EngineConfig
from expresslane.engine.async_engine import AsyncEngine
from expresslane.engine.calibration_cache import CalibrationCache, key_parts
from expresslane.engine.engine import LLMEngine
from expresslane.engine.lane_room import PROMISE_OF_TARGET, _round

SMALL = {"default": {"max_batch": 4}, "flex": {"max_batch": 4}}


def _engine(llama_dir, folder, **options) -> LLMEngine:
    options = {"num_kv_blocks": 256, "max_batch": 4, "lanes": SMALL, "seed": 0, **options}
    return LLMEngine(EngineConfig(model=str(llama_dir), calibration_cache=str(folder), **options))


def _kept(folder) -> list:
    return sorted(folder.glob("*.json"))


def _promise(engine: LLMEngine) -> float:
    return engine.scheduler.room.stated["ultrafast"].tokens_per_s


def test_a_restart_takes_the_kept_calibration_and_states_the_same_promise(llama_dir, tmp_path):
    first = _engine(llama_dir, tmp_path)
    first.calibrate()
    assert len(_kept(tmp_path)) == 1
    # stated from the whole calibration, not from a fit of its first steps
    solo = first.targets.per_request()["ultrafast"]
    assert _promise(first) == _round(PROMISE_OF_TARGET * solo)

    second = _engine(llama_dir, tmp_path)
    second.calibrate()
    assert second.num_steps == 0  # not a step timed
    assert second.step_model.calibration == first.step_model.calibration
    assert list(second.step_model.solo_steps) == list(first.step_model.solo_steps)
    assert second.step_model.describe() == first.step_model.describe()
    assert _promise(second) == _promise(first)
    assert second.scheduler.room.stated == first.scheduler.room.stated
    assert len(_kept(tmp_path)) == 1


def test_other_settings_or_model_files_measure_anew(llama_dir, tmp_path):
    base = EngineConfig(model=str(llama_dir), max_batch=4)
    device = base.torch_device()
    parts = key_parts(base, llama_dir, device)
    same = key_parts(EngineConfig(model=str(llama_dir), max_batch=4, seed=7), llama_dir, device)
    assert CalibrationCache(tmp_path, same).path == CalibrationCache(tmp_path, parts).path
    other = key_parts(EngineConfig(model=str(llama_dir), max_batch=8), llama_dir, device)
    assert CalibrationCache(tmp_path, other).path != CalibrationCache(tmp_path, parts).path

    copy = tmp_path / "model"
    copy.mkdir()
    for f in llama_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    moved = key_parts(EngineConfig(model=str(copy), max_batch=4), copy, device)
    assert CalibrationCache(tmp_path, moved).path != CalibrationCache(tmp_path, parts).path


def test_an_unreadable_calibration_is_measured_anew_and_replaced(llama_dir, tmp_path):
    first = _engine(llama_dir, tmp_path)
    first.calibrate()
    (kept,) = _kept(tmp_path)
    kept.write_text('{"steps": {"small": [[1, 2]]}')  # cut short
    again = _engine(llama_dir, tmp_path)
    again.calibrate()
    assert again.num_steps > 0 and again.step_model.ready
    assert json.loads(kept.read_text())["steps"]["solo"]  # whole again

    kept.write_text(json.dumps({"steps": {"small": [[1, 2]], "large": [], "solo": []}}))
    third = _engine(llama_dir, tmp_path)
    third.calibrate()  # parses, but the steps have the wrong shape
    assert third.num_steps > 0 and third.step_model.ready


def test_off_keeps_nothing(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EXPRESSLANE_CALIBRATION_CACHE", str(tmp_path))
    engine = _engine(llama_dir, "off")
    engine.calibrate()
    assert engine.step_model.ready
    assert not _kept(tmp_path)


def _wait_for(check, what: str, limit: float = 300.0) -> None:
    end = time.monotonic() + limit
    while not check():
        assert time.monotonic() < end, what
        time.sleep(0.01)


async def _generate(served: AsyncEngine, prompt: str, n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ids = []
    async for out in served.submit(prompt, params):
        ids += out.new_token_ids
    return ids


def test_a_server_answers_while_its_calibration_is_measured(llama_dir, tmp_path):
    """Ready before the calibration is measured: requests between its steps interrupt it, are
    answered as the engine alone answers them, and the promise is stated once it is done."""
    engine = _engine(llama_dir, tmp_path)
    served = AsyncEngine(engine, serve_while_calibrating=True)
    try:
        assert served.ready.wait(60)
        assert served.promises() == {}  # not measured yet: /v1/tiers says "measuring"
        answers = [asyncio.run(_generate(served, f"def f{i}(x):", 24)) for i in range(3)]
        _wait_for(lambda: "ultrafast" in served.promises(), "the promise is stated")
        assert len(_kept(tmp_path)) == 1
        assert engine.kv.num_used_blocks == 0
        assert not engine.requests
    finally:
        served.shutdown()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = LLM(str(llama_dir), seed=0)
    assert answers == [alone.generate(f"def f{i}(x):", params)[0].token_ids for i in range(3)]
