// Fuzz target: bytes -> ConfigReader::from_text -> train_config_from_json -> config_warnings, the
// path `shardswap train --config` takes. Bad input must end in ConfigError (naming the key or
// the file); a build without CUDA may also refuse backend "cuda" with BackendUnavailable. Any
// other exception escapes and aborts, which libFuzzer reports as a crash.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "shardswap/config_json.h"
#include "shardswap/config_reader.h"
#include "shardswap/error.h"
#include "trainer/train.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    shardswap::ConfigReader reader = shardswap::ConfigReader::from_text(text, "fuzz.json");
    const shardswap::TrainConfig config = shardswap::train_config_from_json(reader);
    const auto warnings = shardswap::config_warnings(reader);
    (void)config;
    (void)warnings;
  } catch (const shardswap::ConfigError&) {
  } catch (const shardswap::BackendUnavailable&) {
  }
  return 0;
}
