# [Note: no torch import here]
# pip builds the package in an isolated environment without torch, so this file must not import
# it. The C++ kernels under csrc/ are compiled just in time at first use (cached by
# torch.utils.cpp_extension), and the package works without them.
from setuptools import setup

setup()
