#!/usr/bin/env bash
# device: copy the carried part into the kit folder ($1: /tmp/gk or /tmp/gk-0.33.0)
mkdir -p "$1" && cp .gpukit/send/* "$1"/ && ls -la "$1" | tail -3
