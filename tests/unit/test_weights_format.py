"""The weights folder's digests (`shared.weights_format`): per-file xxh3_128 digests computed while
writing, the folder checksum over them, the check of a folder against its manifest, and the
trainer's writer returning the manifest of what it wrote (`ShardWriter`)."""

import json

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from services.trainer.weight_export import Dealer, ShardWriter
from shared import weights_format
from shared.weights_format import (
    WeightsCorrupted,
    checksum_dir,
    file_digest,
    folder_digests,
    manifest_checksum,
    verify_files,
    write_safetensors,
)

pytestmark = pytest.mark.unit


def _tensors(seed: int, n: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}.weight": torch.randn(32, 16 + i, generator=g) for i in range(n)}


@pytest.fixture
def folder(tmp_path):
    """Four safetensors files written by the writer helper; their folder and returned digests."""
    written = {
        f"model-{i}.safetensors": write_safetensors(tmp_path / f"model-{i}.safetensors", _tensors(i)) for i in range(4)
    }
    (tmp_path / "config.json").write_text("{}")  # not a weights file: outside the manifest
    return tmp_path, written


def test_a_digest_is_the_xxh3_128_of_the_bytes_read_in_chunks(tmp_path, monkeypatch):
    data = bytes(range(256)) * 4001  # not a multiple of the chunk
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(weights_format, "_CHUNK", 4096)
    expected = "xxh3_128:" + xxhash.xxh3_128(data).hexdigest()
    assert file_digest(tmp_path / "f") == expected
    assert len(expected) == len("xxh3_128:") + 32


def test_the_writer_returns_the_digest_of_what_it_wrote_and_the_checksum_is_over_those(folder):
    path, written = folder
    for name, digest in written.items():
        assert digest == "xxh3_128:" + xxhash.xxh3_128((path / name).read_bytes()).hexdigest()
        assert load_file(path / name).keys() == _tensors(0).keys()
    assert folder_digests(path) == written
    assert checksum_dir(path) == manifest_checksum(written)
    assert checksum_dir(path).startswith("xxh3_128:")
    # The checksum covers the names as well as the bytes.
    a, b = sorted(written)[:2]
    assert manifest_checksum({**written, a: written[b], b: written[a]}) != manifest_checksum(written)


def test_digests_in_parallel_threads_equal_serial_ones(folder):
    path, written = folder
    assert folder_digests(path, max_workers=1) == folder_digests(path, max_workers=4) == written


def test_verify_files_accepts_the_folder_of_its_manifest(folder):
    path, written = folder
    verify_files(path, written)
    verify_files(path, written, max_workers=1)


def test_verify_files_names_a_file_with_a_flipped_byte(folder):
    path, written = folder
    f = path / "model-2.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(WeightsCorrupted, match="'model-2.safetensors'.*has digest"):
        verify_files(path, written)
    assert isinstance(WeightsCorrupted("x"), ValueError)


def test_verify_files_names_a_missing_file(folder):
    path, written = folder
    (path / "model-1.safetensors").unlink()
    with pytest.raises(WeightsCorrupted, match="'model-1.safetensors' is missing from"):
        verify_files(path, written)


def test_verify_files_names_a_file_not_in_the_manifest(folder):
    path, written = folder
    write_safetensors(path / "model-9.safetensors", _tensors(9))
    with pytest.raises(WeightsCorrupted, match="'model-9.safetensors' is not in the manifest"):
        verify_files(path, written)


def test_the_shard_writer_returns_the_manifest_of_its_files(tmp_path):
    tensors = {f"layer.{i}.weight": torch.full((64, 64), float(i)) for i in range(5)}  # 16 KiB each
    writer = ShardWriter(tmp_path, max_shard_bytes=40 * 1024)
    for name, t in tensors.items():
        writer.add(name, t)
    files = writer.close()
    assert len(files) == 3
    assert writer.manifest == folder_digests(tmp_path) == {f.name: file_digest(f) for f in files}
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(writer.manifest)


def test_the_dealer_balances_bytes_and_deals_the_same_hands_every_time():
    sizes = [100, 10, 10, 60, 50, 40, 30, 5, 5]
    dealer = Dealer(3)
    deal = [dealer.owner(s) for s in sizes]
    again = Dealer(3)
    assert [again.owner(s) for s in sizes] == deal
    assert deal[:4] == [0, 1, 2, 1]  # each to the lightest rank, the lowest on a tie
    assert max(dealer.loads) - min(dealer.loads) <= max(sizes)
    assert sum(dealer.loads) == sum(sizes)


def test_the_streamed_file_is_a_safetensors_file_of_the_tensors(tmp_path):
    import torch
    from safetensors.torch import load_file

    tensors = {
        "w": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "i": torch.arange(4, dtype=torch.int64),
        "empty": torch.zeros(0, 2),
    }
    digest = write_safetensors(tmp_path / "m.safetensors", dict(tensors), {"format": "pt"})
    assert digest == file_digest(tmp_path / "m.safetensors")
    back = load_file(str(tmp_path / "m.safetensors"))
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
