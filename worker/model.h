#pragma once
/// The model the engine runs: its hyper-parameters (model/hparams.h) and its
/// bound weights (model/weights.h), both in the ds4_model library so that
/// the supervisor and the proxy read them without the engine.

#include "model/hparams.h"
#include "model/weights.h"
