# megatron-diffckpt in NVIDIA's NGC PyTorch container, running Megatron-LM's own pretrain_gpt.py
# with differential checkpointing. CUDA, torch, transformer-engine, apex and triton come from the
# image; megatron-core, psutil, zlib-ng, Megatron-LM (the checkout of the pinned megatron-core's
# release) and this package are installed on top.
#
#   docker build -t megatron-diffckpt .
#   docker run --gpus all --ipc=host -v /data:/data megatron-diffckpt <Megatron-LM's GPT flags> \
#       --save /data/ckpt --load /data/ckpt --save-interval 500 --diffckpt-mode lowdiff-plus
#
# Pins: the image tag and the Megatron-LM commit below, and the pins of requirements/ (the
# project's one place for package pins) for the packages the image does not provide
# (tests/test_pins.py checks that they agree). This file is linted by the test suite (hadolint);
# it has not been built on the CI machines, which have no container engine.
# The image's Python (3.12) and torch meet megatron-core 0.19's requirements as well; this file
# installs the CPU lane's 0.16.1 (README, "The stack").
ARG NGC_PYTORCH_TAG=25.09-py3
FROM nvcr.io/nvidia/pytorch:${NGC_PYTORCH_TAG}

# Megatron-LM at tag core_v0.16.1 (the release of the pinned megatron-core), by commit.
ARG MEGATRON_LM_COMMIT=55ac7082517c3878ae653c07c09c534b8aed49f6
ADD https://github.com/NVIDIA/Megatron-LM/archive/${MEGATRON_LM_COMMIT}.tar.gz /tmp/megatron-lm.tar.gz
RUN mkdir -p /opt/megatron-lm \
    && tar -xzf /tmp/megatron-lm.tar.gz --strip-components=1 -C /opt/megatron-lm \
    && rm /tmp/megatron-lm.tar.gz
ENV MEGATRON_LM=/opt/megatron-lm

WORKDIR /opt/megatron-diffckpt

# megatron-core, psutil and zlib-ng exactly as pinned for the CPU stack, and what Megatron-LM's
# training loop imports (requirements/megatron-lm.txt; triton is the image's); torch, numpy and
# packaging are the image's own (replacing them would break its CUDA builds of transformer-engine
# and apex).
COPY requirements/cpu.txt requirements/megatron-lm.txt requirements/
RUN grep -E '^(megatron-core|psutil|zlib-ng)==' requirements/cpu.txt > /tmp/requirements-container.txt \
    && grep -E '^(six|regex|pyyaml|pydantic)==' requirements/megatron-lm.txt \
        >> /tmp/requirements-container.txt \
    && pip install --no-cache-dir -r /tmp/requirements-container.txt \
    && rm /tmp/requirements-container.txt

COPY pyproject.toml README.md LICENSE ./
COPY megatron_diffckpt/ megatron_diffckpt/
RUN pip install --no-cache-dir --no-deps .
COPY examples/ examples/

# Megatron-LM's pretrain_gpt.py on every GPU of the node; the arguments are its flags plus the
# --diffckpt-* flags. For several nodes, use examples/gpt/slurm/pretrain_gpt.sbatch.
ENTRYPOINT ["torchrun", "--nproc-per-node=gpu", "examples/gpt/pretrain_gpt_diffckpt.py"]
CMD ["--help"]
