"""SM partitions (deploy_core.sm_partition) and the settings that ask for one: refused off CUDA and outside the
device's SM count with messages that say why; on CUDA the partition's stream confines its kernels (measured on the
H200 with tools/sm_partition_probe.py)."""

from __future__ import annotations

import pytest
import torch

from deploy_core.sm_partition import sm_partition
from foundationpose.estimator import EstimatorConfig
from foundationpose.register_graph import RegisterGraphConfig


def test_a_partition_needs_a_cuda_device() -> None:
    with pytest.raises(ValueError, match=r"^an SM partition needs a CUDA device; got cpu$"):
        sm_partition("cpu", 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SM counts come from a CUDA device")
def test_a_partition_smaller_than_the_device_and_its_stream_runs_work() -> None:
    total = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(ValueError, match=rf"^num_sms must be in 1\.\.{total - 1} \(the device has {total} SMs\); "
                                         rf"got {total}$"):
        sm_partition("cuda", total)
    part = sm_partition("cuda", max(1, total // 2))
    with torch.cuda.stream(part.stream):
        out = torch.arange(1000, device="cuda", dtype=torch.float32).sum()
    part.stream.synchronize()
    assert (out.item(), part.device_sms) == (499500.0, total)


def test_register_sms_settings_are_checked() -> None:
    assert RegisterGraphConfig().sms is None and EstimatorConfig().register_sms is None
    with pytest.raises(ValueError, match=r"^sms must be >= 1 or None, got 0$"):
        RegisterGraphConfig(sms=0)
    with pytest.raises(ValueError, match=r"^register_sms must be >= 1 or None; got -4$"):
        EstimatorConfig(register_sms=-4)


def test_the_server_flag_reaches_the_estimator_config() -> None:
    from server.cli import config_from_args

    assert config_from_args(["--objects", "o", "--register-sms", "96"], {})[0].estimator.register_sms == 96
    assert config_from_args(["--objects", "o"], {"FP_REGISTER_SMS": "64"})[0].estimator.register_sms == 64
    assert config_from_args(["--objects", "o"], {})[0].estimator.register_sms is None
