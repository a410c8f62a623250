"""Test stand-in for ``torch.npu``: one device, no kernels, nothing to synchronise."""

_current = 0


def is_available():
    return True


def device_count():
    return 1


def set_device(device):
    global _current
    _current = getattr(device, "index", device) or 0


def current_device():
    return _current


def synchronize():
    pass


def manual_seed_all(seed):
    pass


def reset_peak_memory_stats():
    pass


def max_memory_allocated():
    return 0


def memory_allocated():
    return 0
