"""Model weights in torch's DCP format (docs/checkpoints.md): `paratrain convert` between DCP, a
paratrain final/ and Hugging Face's layout, bit for bit; a DCP directory (FSDP2's
`{"model": get_model_state_dict(...)}`) as `[model] pretrained`, read a tensor at a time under zero3."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import CPU_ONLY, check_ok, final_weights, max_rel_error, run_cli, write_config
from safetensors.torch import load_file
from test_model_parallel import GPT

from paratrain.cli import main

TESTS = Path(__file__).parent
# the tests' own dcp.save/load in one process, which torch warns of on every call
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def saved_in_one_process(state: dict, path: Path) -> None:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)


def read_in_one_process(like: dict[str, torch.Tensor], path: Path, nested: bool = True) -> dict[str, torch.Tensor]:
    """Plain dcp.load of tensors shaped like `like`, as `{"model": ...}` or flat."""
    values = {k: torch.empty_like(v) for k, v in like.items()}
    dcp.load({"model": values} if nested else values, checkpoint_id=str(path), no_dist=True)
    return values


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


def test_convert_round_trips_dcp_through_safetensors_bit_for_bit(tmp_path, capsys):
    """DCP -> final/ (`paratrain inspect` reads it) -> DCP keeps every tensor's dtype and bytes, and
    plain dcp.load reads the result in one process; a flat (torchtitan) DCP converts the same; bad
    input exits 2 in one line."""
    weights = {
        "embed.weight": torch.randn(7, 4),
        "blocks.0.norm.weight": torch.randn(4).to(torch.bfloat16),
        "blocks.0.count": torch.arange(3),
        "head.weight": torch.tensor([float("nan"), -0.0, 1e-40]),  # NaN, negative zero, a subnormal
    }
    saved_in_one_process({"model": weights, "step": 3}, tmp_path / "dcp")
    check_ok(run_cli("convert", str(tmp_path / "dcp"), str(tmp_path / "final"), "--to", "safetensors"))
    assert bits_equal(load_file(str(tmp_path / "final" / "model.safetensors")), weights)
    assert main(["inspect", str(tmp_path / "final")]) == 0
    assert main(["convert", str(tmp_path / "final"), str(tmp_path / "again"), "--to", "dcp"]) == 0
    assert bits_equal(read_in_one_process(weights, tmp_path / "again"), weights)

    saved_in_one_process(weights, tmp_path / "flat")
    assert main(["convert", str(tmp_path / "flat"), str(tmp_path / "from_flat"), "--to", "safetensors"]) == 0
    assert bits_equal(load_file(str(tmp_path / "from_flat" / "model.safetensors")), weights)

    capsys.readouterr()
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / ".metadata").write_bytes(b"not a pickle")
    for args, named in [
        (["convert", str(tmp_path / "none"), str(tmp_path / "x"), "--to", "dcp"], "no such directory"),
        (["convert", str(tmp_path / "damaged"), str(tmp_path / "x"), "--to", "dcp"], "unreadable DCP metadata"),
        (["convert", str(tmp_path / "dcp"), str(tmp_path / "x"), "--to", "onnx"], "'onnx'"),
        (["convert", str(tmp_path / "dcp"), str(tmp_path / "final"), "--to", "dcp"], "not an empty directory"),
        (["convert", str(tmp_path / "final"), str(tmp_path / "x"), "--to", "hf"], "no config.json"),
    ]:
        code = main(args)
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and named in lines[0], (args, lines)
    assert not (tmp_path / "x").exists()


def fsdp2_dcp(final: Path, dest: Path) -> None:
    """FSDP2's `{"model": get_model_state_dict(...)}` of GPT's model with `final`'s weights."""
    script = [sys.executable, str(TESTS / "fsdp2_dcp.py"), str(final), str(dest), "2", "4", "32", "16"]
    check_ok(subprocess.run(script, capture_output=True, text=True, timeout=300, env={**os.environ, **CPU_ONLY}))


def test_an_fsdp2_dcp_as_pretrained_trains_as_the_same_final_does(tmp_path, gang, capsys):
    """A DCP directory FSDP2 wrote is `pretrained` for the built-in gpt: under zero3 at world 2 (its
    tensors read one dcp.load at a time) the run trains as the one started from the same weights
    as a paratrain final/; a DCP whose tensor has another shape exits 2 naming it."""
    cfg = write_config(tmp_path / "c.toml", GPT.replace("steps = 20", "steps = 4"))
    gang(2).train(cfg, tmp_path / "first")
    fsdp2_dcp(tmp_path / "first" / "final", tmp_path / "dcp")
    for start, run in [(tmp_path / "first" / "final", "from_final"), (tmp_path / "dcp", "from_dcp")]:
        gang(2).train(cfg, tmp_path / run, [f"model.pretrained='{start}'", "parallel.strategy='zero3'"])
    from_dcp, from_final = final_weights(tmp_path / "from_dcp"), final_weights(tmp_path / "from_final")
    assert max_rel_error(from_dcp, from_final, floor=1e-3) <= 1e-4
    assert max_rel_error(from_dcp, final_weights(tmp_path / "first"), floor=1e-3) > 1e-3  # it trained

    reshaped = load_file(str(tmp_path / "first" / "final" / "model.safetensors"))
    reshaped["blocks.1.mlp.fc.weight"] = reshaped["blocks.1.mlp.fc.weight"][:64]
    saved_in_one_process({"model": reshaped}, tmp_path / "wrong")
    capsys.readouterr()
    code = main(["run", str(cfg), "--nproc", "2", "--set", f"model.pretrained='{tmp_path / 'wrong'}'"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "blocks.1.mlp.fc.weight is [64, 32]" in lines[0], lines


def test_a_transformers_models_dcp_as_hf_pretrained_and_back_to_hf(tmp_path):
    """`convert --to dcp` of a save_pretrained directory keeps its config.json beside the DCP files,
    which the hf factory reads as `pretrained` (tied embeddings saved once): whole, and a tensor at a time on the meta device
    (a sharding strategy's way), each value from_pretrained's; `--to hf` makes it a directory
    from_pretrained loads again; a mis-shaped tensor is named by the checks on meta."""
    transformers = pytest.importorskip("transformers")
    from test_finetune import save_pretrained

    from paratrain import config as config_mod
    from paratrain.errors import ConfigError
    from paratrain.models import build_model
    from paratrain.models.hf import hf
    from paratrain.models.materialize import materialize, tensor_names
    from paratrain.models.pretrained import pretrained_on_meta

    save_pretrained("llama", tmp_path / "start")  # tied: its lm_head.weight is not in the files
    assert main(["convert", str(tmp_path / "start"), str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "start").state_dict()
    assert bits_equal(hf(pretrained=str(tmp_path / "dcp")).state_dict(), expected)

    model = pretrained_on_meta(lambda: hf(pretrained=str(tmp_path / "dcp")), str(tmp_path / "dcp"))
    assert model is not None and all(p.is_meta for p in model.parameters())
    kept: dict[int, torch.Tensor] = {}
    materialize(model, 0, lambda meta, value: kept.__setitem__(id(meta), value))
    names = tensor_names(model)
    assert all(torch.equal(kept[id(names[k])], v) for k, v in expected.items())

    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert bits_equal(again, expected)

    wrong = dict(expected, **{"model.norm.weight": expected["model.norm.weight"][:10]})
    saved_in_one_process({"model": wrong}, tmp_path / "wrong")
    shutil.copy(tmp_path / "start" / "config.json", tmp_path / "wrong")
    cfg = config_mod.from_dict({"model": {"factory": "hf", "pretrained": str(tmp_path / "wrong")}})
    with torch.device("meta"), pytest.raises(ConfigError, match=r"^model.pretrained: .* model.norm.weight is \[10\]"):
        build_model(cfg, None)  # as the checks before any worker starts build it


def test_a_flat_dcp_as_pretrained_for_a_users_factory(tmp_path):
    """torchtitan's flat weights-only DCP is `pretrained` for a `module:function` factory: loaded
    whole (dp) and a tensor at a time on meta (zero1-3), batch-norm statistics and counters too."""
    from user_models import bn_cnn

    from paratrain import config as config_mod
    from paratrain.models import build_model, build_model_to_place
    from paratrain.models.materialize import materialize, tensor_names

    torch.manual_seed(1)
    weights = {k: v + torch.rand_like(v.float()).to(v.dtype) for k, v in bn_cnn(channels=3).state_dict().items()}
    saved_in_one_process(weights, tmp_path / "flat")
    model_keys = {"factory": "user_models:bn_cnn", "channels": 3, "pretrained": str(tmp_path / "flat")}
    cfg = config_mod.from_dict({"model": model_keys})
    assert bits_equal(build_model(cfg, None).state_dict(), weights)

    model = build_model_to_place(cfg, None, materializes=True)
    kept: dict[int, torch.Tensor] = {}
    materialize(model, 0, lambda meta, value: kept.__setitem__(id(meta), value))
    names = tensor_names(model)
    assert bits_equal({k: kept[id(names[k])] for k in weights}, weights)


MLP_WITH_CHECKPOINT = """
name = "mlp"
[model]
factory = "mlp"
[data]
factory = "digits"
batch_size = 16
[train]
steps = 2
[checkpoint]
every = 2
"""


def test_convert_reads_a_checkpoint_holding_its_model_whole(tmp_path, gang, capsys):
    """A dp checkpoint step-N converts to the model its run's final/ holds at that step, bit for bit;
    one whose model is in zero's flat shards exits 2 in one line pointing at final/."""
    cfg = write_config(tmp_path / "c.toml", MLP_WITH_CHECKPOINT)
    for strategy in ("dp", "zero2"):
        gang(2).train(cfg, tmp_path / strategy, [f"parallel.strategy='{strategy}'"])
    assert (
        main(["convert", str(tmp_path / "dp" / "checkpoints" / "step-2"), str(tmp_path / "st"), "--to", "safetensors"])
        == 0
    )
    assert bits_equal(load_file(str(tmp_path / "st" / "model.safetensors")), final_weights(tmp_path / "dp"))

    capsys.readouterr()
    code = main(["convert", str(tmp_path / "zero2" / "checkpoints" / "step-2"), str(tmp_path / "x"), "--to", "dcp"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "zero2's flat shards" in lines[0] and "final/" in lines[0], lines
