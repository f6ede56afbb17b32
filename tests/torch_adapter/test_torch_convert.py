"""state_dict <-> state: no copies on the CPU, dtypes kept, integer buffers as counts, strict keys."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="meshkit.torch needs PyTorch (the torch extra)")

import meshkit.torch as mt  # noqa: E402
from meshkit import MeshError  # noqa: E402
from meshkit.state import BFLOAT16  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.uint8, torch.bool])
def test_a_cpu_tensor_and_its_array_share_memory_both_ways(dtype):
    tensor = torch.arange(12).reshape(3, 4).to(dtype)
    array = mt.to_numpy(tensor)
    assert array.shape == (3, 4)
    assert array.ctypes.data == tensor.data_ptr()
    back = mt.from_numpy(array)
    assert back.dtype == dtype and back.data_ptr() == tensor.data_ptr()


def test_bfloat16_crosses_as_its_own_bytes_never_through_float32():
    bits = torch.tensor([0x7FC1, 0x0001, 0x3F81, -0x4080, 0x7F80], dtype=torch.int16)
    tensor = bits.view(torch.bfloat16)  # a NaN payload, a subnormal, ordinary values, inf
    array = mt.to_numpy(tensor)
    assert array.dtype == BFLOAT16
    assert array.view(np.int16).tolist() == bits.tolist()
    assert mt.from_numpy(array).view(torch.int16).tolist() == bits.tolist()


def test_integer_buffers_travel_as_float_counts_and_come_back_rounded_in_their_dtype():
    model = torch.nn.BatchNorm1d(3)
    model.num_batches_tracked.fill_(7)
    state = mt.module_state(model)
    assert state["num_batches_tracked"].dtype == np.float64
    assert state[mt.INT_BUFFERS] == {"num_batches_tracked": "int64"}
    # fedavg of counts 7 and 10 weighted 2:1 is 8.0; 8.4 (say) rounds to 8.
    state["num_batches_tracked"] = np.array(8.4)
    fresh = torch.nn.BatchNorm1d(3)
    mt.load_module_state(fresh, state, where="test")
    assert fresh.num_batches_tracked.dtype == torch.int64
    assert int(fresh.num_batches_tracked) == 8


def test_a_state_whose_keys_differ_from_the_model_is_refused_naming_them():
    state = mt.module_state(torch.nn.Linear(2, 2))
    state["extra.weight"] = state.pop("bias")
    with pytest.raises(MeshError) as info:
        mt.load_module_state(torch.nn.Linear(2, 2), state, where="round 3")
    message = str(info.value)
    assert "round 3" in message and "missing 'bias'" in message
    assert "unexpected 'extra.weight'" in message


def test_a_shape_that_differs_is_refused_naming_the_key():
    state = mt.module_state(torch.nn.Linear(2, 3))
    with pytest.raises(MeshError, match=r"'weight' has shape \[3, 2\], the model's is \[4, 2\]"):
        mt.load_module_state(torch.nn.Linear(2, 4), state, where="load")


def test_a_read_only_array_from_the_wire_converts_without_a_warning(recwarn):
    array = np.ones(4, np.float32)
    array.setflags(write=False)
    assert mt.from_numpy(array).sum() == 4
    assert not [w for w in recwarn if "not writable" in str(w.message)]
