#!/usr/bin/env bash
# test_supervisor_headroom.sh with worker units under a real user manager.
SUP_BACKEND=systemd exec bash "$(dirname "$0")/test_supervisor_headroom.sh"
