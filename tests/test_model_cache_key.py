"""The converted-model cache is named by the GGUF's bytes.

Why: a key of (path, size, mtime) gave one model a new ~0.5 GB conversion (and a minute of dequantizing)
in every fresh venv and after every reinstall, and never removed the old one (23 copies, 11.6 GiB, on
the CI machine).  The oracle is the file content: the same bytes anywhere share one folder, other bytes
of the same size and name do not.
"""

from __future__ import annotations

import os

from minivllm.model.loader import _cache_dir_for


def test_same_bytes_share_a_folder_other_bytes_do_not(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    blob = os.urandom(3 << 20)  # more than one read chunk
    a = tmp_path / "venvA" / "m.gguf"
    b = tmp_path / "venvB" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(blob)
    os.utime(b, (1_000_000_000, 1_000_000_000))  # another install: another path and modification time
    assert _cache_dir_for(a) == _cache_dir_for(b)
    assert _cache_dir_for(a).parent == tmp_path / "cache"
    c = tmp_path / "venvC" / "m.gguf"
    c.parent.mkdir()
    c.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))  # one bit differs in the last chunk
    os.utime(c, (os.stat(a).st_atime, os.stat(a).st_mtime))
    assert _cache_dir_for(c) != _cache_dir_for(a)


def test_a_new_conversion_version_does_not_reuse_an_older_converters_folder(tmp_path, monkeypatch):
    """Version 2 of the conversion added ``rope_freq_factors`` to ``config.json``; a folder version 1 wrote
    lacks it, and a Llama 3 GGUF served from that folder would run plain RoPE.  The folder is never edited in
    place, so the only guard is its name: the same bytes under a bumped version must name another folder."""
    import minivllm.model.loader as loader

    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)))
    current = _cache_dir_for(path)
    monkeypatch.setattr(loader, "CONVERSION_VERSION", loader.CONVERSION_VERSION + 1)
    assert _cache_dir_for(path) != current
    monkeypatch.setattr(loader, "CONVERSION_VERSION", loader.CONVERSION_VERSION - 1)
    assert _cache_dir_for(path) == current
