# megatron-diffckpt in NVIDIA's NGC PyTorch container: CUDA, torch, transformer-engine and apex
# come from the image; megatron-core, psutil and this package are installed on top.
#
# The registry's host name is not written here; pass it when building:
#   docker build --build-arg NGC_REGISTRY=<NGC registry host> -t megatron-diffckpt .
#
# Pins: the image tag below, and the pins of requirements/cpu.txt (the project's one place for
# pins) for the packages the image does not provide (tests/test_pins.py checks that they agree).
# This file is linted by the test suite (hadolint); it has not been built on the CI machines,
# which have no container engine.
ARG NGC_REGISTRY
ARG NGC_PYTORCH_TAG=25.09-py3
FROM ${NGC_REGISTRY}/nvidia/pytorch:${NGC_PYTORCH_TAG}

WORKDIR /opt/megatron-diffckpt

# megatron-core and psutil exactly as pinned for the CPU stack; torch, numpy and packaging are the
# image's own (replacing them would break the image's CUDA builds of transformer-engine and apex).
COPY requirements/cpu.txt requirements/cpu.txt
RUN grep -E '^(megatron-core|psutil)==' requirements/cpu.txt > /tmp/requirements-container.txt \
    && pip install --no-cache-dir -r /tmp/requirements-container.txt \
    && rm /tmp/requirements-container.txt

COPY pyproject.toml README.md LICENSE ./
COPY megatron_diffckpt/ megatron_diffckpt/
RUN pip install --no-cache-dir --no-deps .
COPY examples/ examples/

# GPT pretraining with differential checkpointing, e.g.:
#   docker run --gpus all --ipc=host megatron-diffckpt \
#       torchrun --nproc-per-node 8 examples/gpt/pretrain_gpt.py ... --diffckpt-mode lowdiff-plus
CMD ["megatron-diffckpt", "--help"]
