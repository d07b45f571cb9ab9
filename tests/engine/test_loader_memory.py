"""The loader builds the model in its target dtype and copies each checkpoint tensor in as it
reads it: loading a ~125M-parameter bf16 Llama on the CPU peaks at no more than 1.3x the bf16
weights in resident memory (an fp32 build then a conversion peaked at several times that)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
PEAK_LIMIT = 1.3

# Runs in a fresh process. VmHWM (peak resident memory) is reset after the imports by writing 5
# to /proc/self/clear_refs, so the peak is the load's own. Building the first Llama imports
# ~200 modules (~40 MB, whatever the model's size): a one-layer one is built before the baseline.
MEASURE = r"""
import json, sys
import torch
from safetensors import safe_open
from transformers import LlamaConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_config, load_model, max_positions

def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(key)

path = sys.argv[1]
config = load_config(path)
with torch.device("meta"):
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=1, vocab_size=8), 16)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = kib("VmRSS")
model = load_model(path, config, "bfloat16", torch.device("cpu"), max_positions(config))
peak = kib("VmHWM")
params = dict(model.named_parameters())
with safe_open(f"{path}/model.safetensors", "pt") as f:
    down, qkv = "model.layers.3.mlp.down_proj.weight", "model.layers.3.self_attn.qkv_proj.weight"
    same = [torch.equal(params[down], f.get_tensor(down)),
            torch.equal(params[qkv], torch.cat(
                [f.get_tensor(qkv.replace("qkv", p)) for p in "qkv"])),
            torch.equal(params["lm_head.weight"], f.get_tensor("lm_head.weight"))]
print(json.dumps({"before": before, "peak": peak, "same": same,
                  "dtypes": sorted({str(p.dtype) for p in params.values()}),
                  "weights": sum(p.numel() * p.element_size() for p in params.values())}))
"""


@pytest.fixture(scope="module")
def llama_125m_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama of 127.0M parameters (hidden 768, 12 layers, vocabulary 32000, untied head) with
    random bf16 weights, saved in bf16 (config.json and one model.safetensors)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama_125m")
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=1792,
                         num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                         max_position_embeddings=2048, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"], dtype="bfloat16")
    config.save_pretrained(str(path))
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    h, f = config.hidden_size, config.intermediate_size
    tensors = {"model.embed_tokens.weight": w(config.vocab_size, h), "lm_head.weight":
               w(config.vocab_size, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors.update({p + f"self_attn.{n}_proj.weight": w(h, h) for n in "qkvo"})
        tensors.update({p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h),
                        p + "mlp.down_proj.weight": w(h, f),
                        p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                        p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_loading_bf16_weights_peaks_near_their_size(llama_125m_bf16: Path) -> None:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(llama_125m_bf16)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    m = json.loads(done.stdout.splitlines()[-1])
    assert m["dtypes"] == ["torch.bfloat16"]
    assert m["same"] == [True, True, True]
    assert m["weights"] == 2 * 127_027_968  # 2 x 32000 x 768 + 12 x 6_489_600 + 768
    growth = m["peak"] - m["before"]
    assert growth <= PEAK_LIMIT * m["weights"], (
        f"loading peaked {growth / 2**20:.0f} MiB above the start for "
        f"{m['weights'] / 2**20:.0f} MiB of weights ({growth / m['weights']:.2f}x)")
