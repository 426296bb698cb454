"""The xla environment's CUDA pins (envs/xla/cuda-libs.txt) are exactly what its torch asks for."""

from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

CUDA_LIBS = Path(__file__).resolve().parents[2] / "envs" / "xla" / "cuda-libs.txt"


def test_the_staged_cuda_pins_match_torch_s_own():
    staged = {
        line.strip()
        for line in CUDA_LIBS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    wanted = set()
    for text in metadata.requires("torch"):
        req = Requirement(text)
        if req.name.startswith("nvidia-") and (req.marker is None or req.marker.evaluate()):
            wanted.add(f"{req.name}{req.specifier}")
    assert staged == wanted


def test_every_staged_library_is_installed_at_its_pin():
    for line in CUDA_LIBS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.strip().split("==")
            assert metadata.version(name) == version, name
