// A user's trainer reading its EngineConfig from a DeepSpeed-style JSON file (docs/api.md, section
// 1, shows this code): the engine's keys, an override as `--set` would give it, the trainer's own
// keys in the same file, and the keys nobody read. It prints what it read and exits 0; 2 on a
// config error (the message names the file and the key).
//   usage: shardswap_example_json_config CONFIG.json
#include <cstdio>
#include <exception>
#include <string>

#include "shardswap/batch_sizes.h"
#include "shardswap/config_json.h"
#include "shardswap/config_reader.h"
#include "shardswap/engine_config.h"
#include "shardswap/error.h"

using namespace shardswap;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CONFIG.json\n", argv[0]);
    return 2;
  }
  try {
    const int world_size = 4;  // the ranks this trainer runs with
    // doc-snippet: json
    ConfigReader reader = ConfigReader::from_file(argv[1]);  // ConfigError if unreadable
    reader.set("optimizer.params.lr=0.0005");                 // an override, as --set gives
    const BatchSizes batches = resolve_batch_sizes(reader, world_size);
    const EngineConfig config = engine_config_from_json(reader, batches);  // validated
    const auto steps = reader.integer("steps", 100);  // the trainer's own keys, same file
    for (const auto& warning : config_warnings(reader))  // "auto" values, unread keys
      std::fprintf(stderr, "warning: %s\n", warning.c_str());
    // doc-snippet-end
    std::printf("stage %d, %s, lr %g, micro batch %d x %d accumulation, bucket %zu bytes, %lld steps\n",
                config.stage, dtype_name(config.dtype), config.optimizer.lr, batches.micro_samples,
                config.gradient_accumulation_steps, config.reduce_bucket_bytes,
                static_cast<long long>(steps));
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "json_config: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "json_config: error: %s\n", e.what());
    return 1;
  }
}
