"""HFCheckpoint and load_hf_config on small safetensors directories written per test."""

import json
import re

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from checkpoints.errors import CheckpointError
from checkpoints.hf import HFCheckpoint, load_hf_config

CONFIG = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2}


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "model.embed_tokens.weight": rng.standard_normal((16, 8), dtype=np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((12, 8), dtype=np.float32),
        "model.layers.1.mlp.up_proj.weight": rng.standard_normal((12, 8), dtype=np.float32),
        "model.norm.weight": np.arange(8, dtype=np.float16),
        "model.positions": np.arange(5, dtype=np.int64),
    }


def _write_config(root, config=CONFIG):
    (root / "config.json").write_text(json.dumps(config))


def _single_dir(root, tensors=None):
    _write_config(root)
    save_file(tensors or _tensors(), str(root / "model.safetensors"))
    return root / "model.safetensors"


def _sharded_dir(root):
    tensors = _tensors()
    names = list(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:2],
        "model-00002-of-00002.safetensors": names[2:],
    }
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(root / shard))
        weight_map.update(dict.fromkeys(shard_names, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    _write_config(root)
    return tensors


def test_single_file_round_trip(tmp_path):
    _single_dir(tmp_path)
    expected = _tensors()
    with HFCheckpoint(tmp_path) as ckpt:
        assert ckpt.config == CONFIG
        assert sorted(ckpt.tensor_names()) == sorted(expected)
        for name, value in expected.items():
            got = ckpt.tensor(name)
            assert got.dtype == value.dtype
            np.testing.assert_array_equal(got, value)
        assert dict(ckpt.tensors()).keys() == expected.keys()


def test_sharded_round_trip(tmp_path):
    expected = _sharded_dir(tmp_path)
    ckpt = HFCheckpoint(tmp_path)
    assert sorted(ckpt.tensor_names()) == sorted(expected)
    for name, value in ckpt.tensors():
        np.testing.assert_array_equal(value, expected[name])
    assert "model.norm.weight" in ckpt and "nope" not in ckpt


def test_any_safetensors_files_without_index(tmp_path):
    _write_config(tmp_path)
    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "consolidated.safetensors"))
    save_file({"b": np.zeros(2, np.int32)}, str(tmp_path / "extra.safetensors"))
    ckpt = HFCheckpoint(tmp_path)
    assert ckpt.tensor_names() == ["a", "b"]
    np.testing.assert_array_equal(ckpt.tensor("b"), np.zeros(2, np.int32))


def test_duplicate_tensor_across_unindexed_files(tmp_path):
    _write_config(tmp_path)
    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "one.safetensors"))
    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(CheckpointError, match="one.safetensors.*two.safetensors"):
        HFCheckpoint(tmp_path)


def test_bf16_stays_bf16(tmp_path):
    value = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    _single_dir(tmp_path, {"w": value})
    got = HFCheckpoint(tmp_path).tensor("w")
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    assert got.shape == (3, 4)
    np.testing.assert_array_equal(got.view(np.uint16), value.view(np.uint16))


def test_fp8_read_through_memmap(tmp_path):
    value = np.array([0.5, -1.0, 2.0, 448.0], dtype=ml_dtypes.float8_e4m3fn)
    header = json.dumps({"w": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [0, 4]}})
    header = header.encode().ljust(64)
    (tmp_path / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + value.tobytes()
    )
    _write_config(tmp_path)
    got = HFCheckpoint(tmp_path).tensor("w")
    assert got.dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), value)


def test_unknown_tensor_names_close_matches(tmp_path):
    _single_dir(tmp_path)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weights.*model\.norm\.weight"):
        HFCheckpoint(tmp_path).tensor("model.norm.weights")


def test_load_hf_config_accepts_dir_or_file(tmp_path):
    _write_config(tmp_path)
    assert load_hf_config(tmp_path) == CONFIG
    assert load_hf_config(tmp_path / "config.json") == CONFIG


def test_missing_config(tmp_path):
    save_file(_tensors(), str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="config.json"):
        HFCheckpoint(tmp_path)


def test_invalid_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json.*not valid JSON"):
        load_hf_config(tmp_path)


def test_corrupted_header(tmp_path):
    file = _single_dir(tmp_path)
    data = bytearray(file.read_bytes())
    data[8:20] = b"\xff\x00garbage!!\x13"
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors.*corrupted header"):
        HFCheckpoint(tmp_path)


def test_corrupted_header_length(tmp_path):
    file = _single_dir(tmp_path)
    data = bytearray(file.read_bytes())
    data[0:8] = (2**40).to_bytes(8, "little")
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors.*header length"):
        HFCheckpoint(tmp_path)


@pytest.mark.parametrize("keep_bytes", [4, 40, -10])
def test_truncated_file(tmp_path, keep_bytes):
    file = _single_dir(tmp_path)
    data = file.read_bytes()
    file.write_bytes(data[:keep_bytes])
    with pytest.raises(CheckpointError, match="model.safetensors.*(too short|truncated)"):
        HFCheckpoint(tmp_path)


def test_offsets_inconsistent_with_shape(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + bytes(8)
    )
    _write_config(tmp_path)
    with pytest.raises(
        CheckpointError, match=r"model.safetensors.*'w'.*spans 8 bytes, expected 16"
    ):
        HFCheckpoint(tmp_path)


def test_index_names_missing_shard(tmp_path):
    _sharded_dir(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"model.safetensors.index.json.*model-00002-of-00002.safetensors"
    ):
        HFCheckpoint(tmp_path)


def test_shard_missing_promised_tensor(tmp_path):
    _sharded_dir(tmp_path)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError,
        match=r"index.json.*'model.ghost.weight'.*model-00001-of-00002.safetensors",
    ):
        HFCheckpoint(tmp_path)


def test_only_pytorch_weights(tmp_path):
    _write_config(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    with pytest.raises(CheckpointError, match=r"no safetensors.*pytorch_model\.bin"):
        HFCheckpoint(tmp_path)


def test_no_weights_at_all(tmp_path):
    _write_config(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(f"no safetensors weights in {tmp_path}")):
        HFCheckpoint(tmp_path)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        HFCheckpoint(tmp_path / "nowhere")
