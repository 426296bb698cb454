"""Emulated ``parallel_layers/parallel_state.py``: tensor parallelism over the emulated NeuronCores."""

from gemma_nb.rehearsal.nxd_layers import ParallelState, set_state, state_or_none


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              expert_model_parallel_size: int = 1, **ignored) -> None:
    if pipeline_model_parallel_size != 1 or expert_model_parallel_size != 1:
        raise NotImplementedError("the emulated SDK keeps tensor parallelism only (pipeline and expert degree 1)")
    set_state(ParallelState(tensor_model_parallel_size, spmd=True))


def destroy_model_parallel() -> None:
    set_state(None)


def model_parallel_is_initialized() -> bool:
    return state_or_none() is not None


def get_tensor_model_parallel_group():
    state = state_or_none()
    if state is None:
        raise AssertionError("tensor model parallel group is not initialized")
    return state


def get_tensor_model_parallel_size() -> int:
    return get_tensor_model_parallel_group().tp


def get_tensor_model_parallel_rank() -> int:
    return get_tensor_model_parallel_group().rank


def get_expert_model_parallel_size() -> int:
    return 1
