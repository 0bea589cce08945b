// The operation tables behind a Backend (internal): the device operations the engine runs on its
// memory, and the element work of in-process collectives there.
#pragma once

#include "engine/comm/collective_ops.h"
#include "optimizer/optimizer.h"
#include "shardswap/backend.h"

namespace shardswap {

const DeviceOps& device_ops(const Backend& backend);
const CollectiveOps& collective_ops(const Backend& backend);

}  // namespace shardswap
