"""`paratrain plan` against published runs it was not fitted to: torchtitan's Llama 3.1 8B on H100s
(pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3: FSDP, local batch
2, sequence 8192, bf16, selective activation checkpointing), planned as the equivalent paratrain
job: a transformers Llama with Llama 3.1 8B's shapes on fake tensors, zero3, train.recompute =
"selective", bf16, on nodes of 8 h100-sxm. Megatron-LM's Table 1 rows are in test_plan_predict.py
(test_megatron_table_1_within_10_percent).

The machines, as the benchmark describes them: H100 SXM parts with 96 GB of HBM2e at 2.4 TB/s,
run at a 500 W power limit (of the SXM part's 700 W), whose dense bf16 peak the benchmark puts
"between SXM and NVL" without knowing it: the cluster takes the lower bound, the H100 NVL's data
sheet 835 TFLOP/s, as the 500 W cap's (an assumption, stated here); every other figure is the
h100-sxm preset's (cost/cluster.py says where each comes from)."""

import pytest
import torch

pytest.importorskip("transformers")

LLAMA_3_1_8B = (
    '{ model_type = "llama", vocab_size = 128256, hidden_size = 4096, intermediate_size = 14336, '
    "num_hidden_layers = 32, num_attention_heads = 32, num_key_value_heads = 8, "
    "max_position_embeddings = 8192, rope_theta = 500000.0, rms_norm_eps = 1e-5, tie_word_embeddings = false }"
)

# GPUs, torch.compile, tokens/s per GPU, memory GiB (Table 1: 8 GPUs; Table 3: 128 GPUs)
TORCHTITAN_8B = [
    (8, False, 5762, 82.4),
    (8, True, 6667, 77.0),
    (128, False, 5605, 67.0),
    (128, True, 6514, 62.0),
]
PART = {"device": "h100-sxm", "memory_gib": 96, "hbm_GBps": 2400, "peak_tflops": 835}


JOB = """
[model]
factory = "hf"
task = "causal-lm"
config = {config}
[data]
factory = "user_models:token_blocks"
vocab = 128256
block = 8192
n = {batch}
batch_size = {batch}
[train]
precision = "bf16"
recompute = "selective"
optimizer = "adamw"
compile = {compiled}
[parallel]
strategy = "zero3"
"""


def plan_row(where, gpus: int, compiled: bool) -> dict:
    from paratrain.config import load
    from paratrain.cost.cluster import parse_cluster
    from paratrain.data import build_dataset
    from paratrain.models import build_model
    from paratrain.plan.planner import make_plan

    batch = 2 * gpus  # local batch 2
    job = where / f"llama-{gpus}-{compiled}.toml"
    job.write_text(JOB.format(config=LLAMA_3_1_8B, batch=batch, compiled=str(compiled).lower()))
    cfg = load(str(job), [])
    cluster = parse_cluster({"nodes": gpus // 8, "devices_per_node": 8, **PART})
    with torch.device("meta"):
        model = build_model(cfg, build_dataset(cfg, "train"))
    return make_plan(cfg, model, 8, gpus // 8, "cuda", cluster)


@pytest.fixture(scope="module")
def predicted(tmp_path_factory):
    """Each row's plan; the fake-tensor traces played once for all four (the same microbatch)."""
    from paratrain.plan.traces import memoised_traces

    where = tmp_path_factory.mktemp("torchtitan")
    with memoised_traces():
        return {(gpus, compiled): plan_row(where, gpus, compiled) for gpus, compiled, *_ in TORCHTITAN_8B}


@pytest.mark.parametrize("gpus, compiled, published, memory_gib", TORCHTITAN_8B)
def test_torchtitan_llama3_8b_tokens_per_second(predicted, gpus, compiled, published, memory_gib):
    """Under torchtitan's op policy (models/recompute.py: every other matmul runs again): eager,
    6,126 tokens/s per GPU predicted on 8 GPUs against 5,762 (+6.3 %), 6,152 on 128 against 5,605
    (+9.8 %); compiled, 7,390 against 6,667 (+10.8 %), 7,427 against 6,514 (+14.0 %)."""
    plan = predicted[gpus, compiled]
    per_gpu = plan["predicted"]["tokens_per_s"] / gpus
    assert abs(per_gpu / published - 1) <= 0.15, (per_gpu, published, plan["step_breakdown"])


@pytest.mark.parametrize("gpus, compiled, published, memory_gib", TORCHTITAN_8B)
def test_torchtitan_llama3_8b_memory(predicted, gpus, compiled, published, memory_gib):
    """Peak memory per GPU (torchtitan's tables give its allocator's reserved peak), zero3 gathering
    bf16 units as FSDP2 with torchtitan's bf16 param_dtype does: 72.8 GiB predicted on 8 GPUs
    against 82.4 eager (-11.7 %) and 77.0 compiled (-5.5 %), 60.5 on 128 against 67.0 (-9.7 %) and
    62.0 (-2.4 %). The plan gives the eager peak for a compiled run too (what compile saves is not
    modelled), and the allocated peak, which a reserved peak exceeds by the allocator's slack."""
    peak = predicted[gpus, compiled]["predicted"]["peak_memory_gib"]
    assert abs(peak / memory_gib - 1) <= 0.15, (peak, memory_gib)
