"""dtype "auto" (the default of EngineConfig, LLM and `genq worker --dtype`): the checkpoint's
dtype as config.json states it, bfloat16 on CUDA for a float32 checkpoint (float16 on a GPU
without bfloat16); on the CPU always the checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.models.loader import load_config, resolve_dtype
from worker.main import build_parser

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def _config(tmp_path: Path, stated: dict[str, str]) -> object:
    """A config.json as a checkpoint ships it, read back through AutoConfig."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **stated}))
    return load_config(str(path))


@pytest.mark.parametrize("stated, device, bf16, expected", [
    ({"dtype": "float32"}, CPU, None, "float32"),
    ({"dtype": "bfloat16"}, CPU, None, "bfloat16"),
    ({"torch_dtype": "float16"}, CPU, None, "float16"),  # the key before transformers 4.56
    ({}, CPU, None, "float32"),  # no dtype stated: transformers assumes float32
    ({"dtype": "float64"}, CPU, None, "float32"),
    ({"dtype": "float32"}, CUDA, True, "bfloat16"),
    ({"dtype": "float16"}, CUDA, True, "float16"),
    ({"dtype": "bfloat16"}, CUDA, True, "bfloat16"),
    ({"dtype": "bfloat16"}, CUDA, False, "float16"),
    ({"dtype": "float32"}, CUDA, False, "float16"),
    ({}, CUDA, True, "bfloat16"),
])
def test_auto_resolves_from_the_checkpoint_and_the_device(
        tmp_path: Path, stated: dict[str, str], device: torch.device, bf16: bool | None,
        expected: str) -> None:
    assert resolve_dtype("auto", _config(tmp_path, stated), device, bf16) == expected


@pytest.mark.parametrize("requested", ["float32", "float16", "bfloat16"])
def test_an_explicit_dtype_is_kept(tmp_path: Path, requested: str) -> None:
    config = _config(tmp_path, {"dtype": "bfloat16"})
    assert resolve_dtype(requested, config, CUDA, False) == requested
    assert resolve_dtype(requested, config, CPU) == requested


def test_auto_is_the_default_of_the_engine_and_the_worker() -> None:
    assert EngineConfig(model="m").dtype == "auto"
    assert build_parser().parse_args(["--model", "m"]).dtype == "auto"


def test_the_engine_runs_a_bf16_checkpoint_in_bf16_on_the_cpu(
        tmp_path: Path, tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path / "llama_bf16"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.bfloat16)
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(tiny_llama)).save_pretrained(str(path))
    llm = LLM(str(path), kv_cache_memory=1 << 24)
    assert llm.engine.config.dtype == "bfloat16"
    assert {p.dtype for p in llm.engine.model.parameters()} == {torch.bfloat16}
    assert llm.engine.kv_cache.device_cache.dtype == torch.bfloat16
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    fp32 = LLM(str(tiny_llama), kv_cache_memory=1 << 24)
    assert fp32.engine.config.dtype == "float32"
    assert {p.dtype for p in fp32.engine.model.parameters()} == {torch.float32}
