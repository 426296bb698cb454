"""Instance catalog, device table and fit arithmetic (docs/sources.md: inf2-instances,
ec2-pricing)."""

from types import SimpleNamespace

import pytest

from gemma_nb import hardware
from gemma_nb.hardware import GB, GiB, fits, get_instance


def test_catalog_matches_facts():
    xl = get_instance("inf2.xlarge")
    got = (xl.chips, xl.neuron_cores, xl.vcpus, xl.host_ram_gib, xl.hbm_gib, xl.usd_per_hour)
    assert got == (1, 2, 4, 16, 32, 0.7582)
    assert get_instance("inf2.8xlarge").host_ram_gib == 128
    assert get_instance("inf2.24xlarge").neuron_cores == 12
    assert get_instance("inf2.48xlarge").usd_per_hour == 12.9813
    for inst in hardware.INSTANCES.values():
        assert inst.hbm_per_core_bytes == 16 * GiB  # every inf2 core: 16 GiB
        assert inst.budget_bytes("spec") == 16 * GiB
        assert inst.budget_bytes("story") == 16 * GB


def test_instance_table_shows_gib_and_gb():
    table = hardware.instance_table().set_index("instance")
    assert table.loc["inf2.xlarge", "hbm_per_core_gib"] == 16
    assert table.loc["inf2.xlarge", "hbm_per_core_gb"] == pytest.approx(17.18, abs=1e-3)


def test_fits_headroom_and_too_few_cores():
    fit = fits(SimpleNamespace(tp=2, total_bytes=14 * GB), "inf2.xlarge")
    assert fit.fits and fit.headroom_bytes == 16 * GiB - 14 * GB and fit.replicas == 1
    story = fits(SimpleNamespace(tp=2, total_bytes=16 * GB + 1), "inf2.xlarge", budget="story")
    assert not story.fits and story.headroom_bytes == -1 and "short by" in story.reason
    wide = fits(SimpleNamespace(tp=8, total_bytes=1), "inf2.xlarge")
    assert (
        not wide.fits and wide.headroom_bytes is None and "TP=8 needs 8 NeuronCores" in wide.reason
    )
    assert fits(SimpleNamespace(tp=2, total_bytes=1), "inf2.24xlarge").replicas == 6
    assert fit.headroom_gb == pytest.approx((16 * GiB - 14 * GB) / GB)


def test_devices_and_measured_cpu():
    devices = hardware.DEVICES
    assert devices["inferentia2_chip"].bf16_flops == 190 * hardware.TERA
    assert devices["neuroncore_v2"].bandwidth_bytes_s == 410 * GiB
    assert devices["tpu_v6e_chip"].usd_per_hour == 2.70
    cpu = hardware.measured_cpu(24e9)
    assert cpu.name == "this_cpu" and cpu.bandwidth_bytes_s == 24e9


def test_bad_input():
    with pytest.raises(ValueError, match="'inf2.small'.*known: inf2.xlarge"):
        get_instance("inf2.small")
