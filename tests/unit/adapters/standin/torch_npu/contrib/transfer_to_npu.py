"""Test stand-in: the real module redirects torch.cuda to the NPU; here importing it is the point."""
