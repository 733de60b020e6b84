/*
 * llmem/llmem.h — the whole public API of libllmem in one include.
 */
#ifndef LLMEM_H
#define LLMEM_H

#include "llmem/status.h"
#include "llmem/size.h"
#include "llmem/sys.h"
#include "llmem/plan.h"
#include "llmem/mem.h"
#include "llmem/kv.h"
#include "llmem/backend.h"
#include "llmem/model.h"

#endif
