// Layer-switching schedules (LISA, BAdam, explicit): which groups are active at each step, the
// layer_switching JSON section, and the errors that name the key of a bad value.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "shardswap/schedule.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"

using namespace shardswap;

namespace {

using Names = std::vector<std::string>;

/// input, layers.0 .. layers.{depth-1}, head: the built-in model's groups.
Names model_groups(int depth) {
  Names groups{"input"};
  for (int i = 0; i < depth; ++i) groups.push_back("layers." + std::to_string(i));
  groups.push_back("head");
  return groups;
}

Names body(int depth) {
  Names layers;
  for (int i = 0; i < depth; ++i) layers.push_back("layers." + std::to_string(i));
  return layers;
}

LayerSwitchingConfig lisa(int depth, int gamma, std::uint64_t seed = 0) {
  LayerSwitchingConfig c;
  c.type = SwitchingType::lisa;
  c.interval = 5;
  c.gamma = gamma;
  c.layers = body(depth);
  c.always_active = {"input", "head"};
  c.seed = seed;
  return c;
}

LayerSwitchingConfig badam(int depth, BlockOrder order, std::uint64_t seed = 0) {
  LayerSwitchingConfig c;
  c.type = SwitchingType::badam;
  c.interval = 3;
  c.layers = body(depth);
  c.order = order;
  c.seed = seed;
  return c;
}

LayerSwitchingConfig explicit_table() {
  LayerSwitchingConfig c;
  c.type = SwitchingType::explicit_list;
  c.always_active = {"input"};
  c.steps = {{0, {"layers.0"}}, {5, {"layers.1", "layers.2"}}, {12, {"head"}}};
  return c;
}

/// The groups active at step `step` that are not in `exclude`.
Names without(const Names& active, const Names& exclude) {
  Names out;
  for (const auto& g : active)
    if (std::find(exclude.begin(), exclude.end(), g) == exclude.end()) out.push_back(g);
  return out;
}

bool has(const Names& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string schedule_error(const LayerSwitchingConfig& c, int depth = 4) {
  return test::message_of<ConfigError>([&] { LayerSchedule(c, model_groups(depth)); });
}

LayerSwitchingConfig from_json(const char* text) {
  ConfigReader reader(nlohmann::json::parse(text), "test.json");
  return layer_switching_from_json(reader);
}

std::string json_error(const char* text) {
  return test::message_of<ConfigError>([&] { from_json(text); });
}

}  // namespace

// ---- none ----------------------------------------------------------------------------------

TEST_CASE("without layer switching every group is active at every step and none is a boundary") {
  const LayerSchedule schedule(LayerSwitchingConfig{}, model_groups(3));
  REQUIRE_FALSE(schedule.enabled());
  for (std::int64_t step : {0, 1, 10, 1000}) {
    REQUIRE(schedule.active_at(step) == model_groups(3));
    REQUIRE_FALSE(schedule.boundary(step));
  }
}

// ---- LISA ----------------------------------------------------------------------------------

TEST_CASE("LISA activates gamma distinct layers of its list in every period") {
  const LayerSchedule schedule(lisa(8, 3), model_groups(8));
  for (std::int64_t step = 0; step < 500; step += 5) {
    const auto drawn = without(schedule.active_at(step), {"input", "head"});
    CAPTURE(step);
    REQUIRE(drawn.size() == 3);
    REQUIRE(std::set<std::string>(drawn.begin(), drawn.end()).size() == 3);
    for (const auto& g : drawn) REQUIRE(has(body(8), g));
  }
}

TEST_CASE("LISA keeps the always-active groups active and never draws them") {
  const LayerSchedule schedule(lisa(6, 2), model_groups(6));
  for (std::int64_t step = 0; step < 500; step += 5) {
    const auto active = schedule.active_at(step);
    CAPTURE(step);
    REQUIRE(has(active, "input"));
    REQUIRE(has(active, "head"));
    // Two always-active groups plus gamma drawn ones: none of the draws fell on them.
    REQUIRE(active.size() == 4);
  }
}

TEST_CASE("LISA changes the active set only at interval boundaries") {
  auto c = lisa(8, 2);
  c.interval = 7;
  const LayerSchedule schedule(c, model_groups(8));
  int changes = 0;
  for (std::int64_t step = 0; step < 300; ++step) {
    CAPTURE(step);
    REQUIRE(schedule.boundary(step) == (step % 7 == 0));
    if (step == 0) continue;
    const bool changed = schedule.active_at(step) != schedule.active_at(step - 1);
    if (!schedule.boundary(step)) REQUIRE_FALSE(changed);
    changes += changed;
  }
  REQUIRE(changes > 20);  // 42 boundaries; a new draw repeats the old set with p = 1/28
}

TEST_CASE("LISA draws are reproducible: the same seed gives the same sets, another seed differs") {
  const LayerSchedule a(lisa(8, 2, 11), model_groups(8));
  const LayerSchedule b(lisa(8, 2, 11), model_groups(8));
  const LayerSchedule other(lisa(8, 2, 12), model_groups(8));
  bool differs = false;
  for (std::int64_t step = 0; step < 500; step += 5) {
    REQUIRE(a.active_at(step) == b.active_at(step));
    differs = differs || a.active_at(step) != other.active_at(step);
  }
  REQUIRE(differs);
}

TEST_CASE("LISA draws each layer with a frequency within 5% of gamma over n") {
  const int n = 8, gamma = 3, periods = 10'000;
  auto c = lisa(n, gamma, 2024);
  c.interval = 1;
  const LayerSchedule schedule(c, model_groups(n));
  std::map<std::string, int> count;
  for (std::int64_t step = 0; step < periods; ++step)
    for (const auto& g : without(schedule.active_at(step), {"input", "head"})) ++count[g];
  const double expected = static_cast<double>(gamma) / n;
  for (const auto& layer : body(n)) {
    const double frequency = static_cast<double>(count[layer]) / periods;
    CAPTURE(layer, frequency, expected);
    REQUIRE(std::abs(frequency - expected) <= 0.05 * expected);
  }
}

TEST_CASE("LISA's first draws for seed 42 are fixed, so a change of generator is caught") {
  auto c = lisa(8, 2, 42);
  c.interval = 1;
  c.always_active = {};
  const LayerSchedule schedule(c, model_groups(8));
  // Checked against an independent implementation of the same generator (splitmix64 seeded
  // with mix(mix(seed ^ "lisa") + period), rejection draws, partial Fisher-Yates).
  const std::vector<Names> expected = {
      {"layers.2", "layers.4"}, {"layers.2", "layers.7"}, {"layers.2", "layers.5"},
      {"layers.0", "layers.6"}, {"layers.0", "layers.6"}, {"layers.1", "layers.5"},
      {"layers.0", "layers.4"}, {"layers.0", "layers.5"},
  };
  for (std::int64_t step = 0; step < 8; ++step) {
    CAPTURE(step);
    REQUIRE(schedule.active_at(step) == expected[static_cast<std::size_t>(step)]);
  }
}

// ---- BAdam ---------------------------------------------------------------------------------

TEST_CASE("BAdam ascending activates one block per interval in list order, epoch after epoch") {
  auto c = badam(4, BlockOrder::ascending);
  c.always_active = {"head"};
  const LayerSchedule schedule(c, model_groups(4));
  for (std::int64_t step = 0; step < 3 * 4 * 3; ++step) {
    const auto block = "layers." + std::to_string((step / 3) % 4);
    CAPTURE(step);
    REQUIRE(schedule.active_at(step) == Names{block, "head"});
    REQUIRE(schedule.boundary(step) == (step % 3 == 0));
  }
}

TEST_CASE("BAdam descending activates the blocks from the last of the list to the first") {
  const LayerSchedule schedule(badam(4, BlockOrder::descending), model_groups(4));
  for (std::int64_t step = 0; step < 3 * 4 * 3; ++step) {
    CAPTURE(step);
    REQUIRE(schedule.active_at(step) == Names{"layers." + std::to_string(3 - (step / 3) % 4)});
  }
}

TEST_CASE("BAdam follows the order of its list, not the model's") {
  auto c = badam(4, BlockOrder::ascending);
  c.layers = {"layers.2", "input", "layers.0"};
  const LayerSchedule schedule(c, model_groups(4));
  REQUIRE(schedule.active_at(0) == Names{"layers.2"});
  REQUIRE(schedule.active_at(3) == Names{"input"});
  REQUIRE(schedule.active_at(6) == Names{"layers.0"});
  REQUIRE(schedule.active_at(9) == Names{"layers.2"});
}

TEST_CASE("BAdam random visits every block exactly once per epoch") {
  const int n = 6;
  const LayerSchedule schedule(badam(n, BlockOrder::random, 5), model_groups(n));
  for (std::int64_t epoch = 0; epoch < 50; ++epoch) {
    std::set<std::string> seen;
    for (int j = 0; j < n; ++j) {
      const auto active = schedule.active_at((epoch * n + j) * 3 + 1);
      REQUIRE(active.size() == 1);
      seen.insert(active[0]);
    }
    const auto blocks = body(n);
    CAPTURE(epoch);
    REQUIRE(seen == std::set<std::string>(blocks.begin(), blocks.end()));
  }
}

TEST_CASE("BAdam random draws a new order each epoch, the same one for the same seed") {
  const int n = 6;
  const LayerSchedule schedule(badam(n, BlockOrder::random, 5), model_groups(n));
  const LayerSchedule again(badam(n, BlockOrder::random, 5), model_groups(n));
  const auto order = [&](const LayerSchedule& s, std::int64_t epoch) {
    Names out;
    for (int j = 0; j < n; ++j) out.push_back(s.active_at((epoch * n + j) * 3)[0]);
    return out;
  };
  std::set<Names> orders;
  for (std::int64_t epoch = 0; epoch < 10; ++epoch) {
    REQUIRE(order(schedule, epoch) == order(again, epoch));
    orders.insert(order(schedule, epoch));
  }
  REQUIRE(orders.size() >= 9);  // 720 orders: ten draws hardly ever repeat one
}

TEST_CASE("BAdam's random order for seed 7 is fixed, so a change of generator is caught") {
  auto c = badam(5, BlockOrder::random, 7);
  c.interval = 1;
  const LayerSchedule schedule(c, model_groups(5));
  const Names expected = {"layers.2", "layers.3", "layers.1", "layers.0", "layers.4",   // epoch 0
                          "layers.4", "layers.0", "layers.1", "layers.2", "layers.3"};  // epoch 1
  for (std::int64_t step = 0; step < 10; ++step) {
    CAPTURE(step);
    REQUIRE(schedule.active_at(step) == Names{expected[static_cast<std::size_t>(step)]});
  }
}

// ---- explicit ------------------------------------------------------------------------------

TEST_CASE("an explicit schedule activates the entry in force at each step, with always_active") {
  const LayerSchedule schedule(explicit_table(), model_groups(4));
  REQUIRE(schedule.active_at(0) == Names{"input", "layers.0"});
  REQUIRE(schedule.active_at(4) == Names{"input", "layers.0"});
  REQUIRE(schedule.active_at(5) == Names{"input", "layers.1", "layers.2"});
  REQUIRE(schedule.active_at(11) == Names{"input", "layers.1", "layers.2"});
  REQUIRE(schedule.active_at(12) == Names{"input", "head"});
  REQUIRE(schedule.active_at(1'000'000) == Names{"input", "head"});
}

TEST_CASE("an explicit schedule has its boundaries at the entries' first steps") {
  const LayerSchedule schedule(explicit_table(), model_groups(4));
  for (std::int64_t step = 0; step < 20; ++step) {
    CAPTURE(step);
    REQUIRE(schedule.boundary(step) == (step == 0 || step == 5 || step == 12));
  }
}

TEST_CASE("active groups come in the model's declaration order without duplicates") {
  auto c = explicit_table();
  c.steps = {{0, {"head", "layers.1", "input"}}};
  const LayerSchedule schedule(c, model_groups(4));
  REQUIRE(schedule.active_at(0) == Names{"input", "layers.1", "head"});
}

// ---- JSON ----------------------------------------------------------------------------------

TEST_CASE("layer_switching_from_json gives the documented defaults for a missing section") {
  ConfigReader reader(nlohmann::json::object(), "test.json");
  const auto c = layer_switching_from_json(reader);
  REQUIRE(c.type == SwitchingType::none);
  REQUIRE(c.interval == 10);
  REQUIRE(c.gamma == 2);
  REQUIRE(c.order == BlockOrder::ascending);
  REQUIRE(c.seed == 0);
  REQUIRE(c.policy == DeactivatePolicy::drop);
  REQUIRE(c.layers.empty());
  REQUIRE(c.always_active.empty());
  REQUIRE(c.steps.empty());
}

TEST_CASE("layer_switching_from_json reads a LISA section and leaves no key unread") {
  ConfigReader reader(nlohmann::json::parse(R"({"layer_switching": {
    "type": "lisa", "interval": 20, "gamma": 3, "seed": 9, "policy": "keep_host",
    "layers": ["layers.0", "layers.1", "layers.2", "layers.3"],
    "always_active": ["input", "head"]}})"),
                      "test.json");
  const auto c = layer_switching_from_json(reader);
  REQUIRE(c.type == SwitchingType::lisa);
  REQUIRE(c.interval == 20);
  REQUIRE(c.gamma == 3);
  REQUIRE(c.seed == 9);
  REQUIRE(c.policy == DeactivatePolicy::keep_host);
  REQUIRE(c.layers == body(4));
  REQUIRE(c.always_active == Names{"input", "head"});
  REQUIRE(reader.unread_keys().empty());
  LayerSchedule(c, model_groups(4));  // valid
}

TEST_CASE("layer_switching_from_json reads a BAdam section with its defaults") {
  const auto c = from_json(R"({"layer_switching": {"type": "badam", "order": "random",
    "layers": ["layers.1", "layers.0"]}})");
  REQUIRE(c.type == SwitchingType::badam);
  REQUIRE(c.order == BlockOrder::random);
  REQUIRE(c.layers == Names{"layers.1", "layers.0"});
  REQUIRE(c.interval == 10);
  REQUIRE(c.seed == 0);
  REQUIRE(c.policy == DeactivatePolicy::drop);
}

TEST_CASE("layer_switching_from_json reads an explicit schedule and marks its entries read") {
  ConfigReader reader(nlohmann::json::parse(R"({"layer_switching": {"type": "explicit",
    "policy": "keep_device", "always_active": ["head"],
    "schedule": [{"step": 0, "active": ["layers.0"]},
                 {"step": 100, "active": ["layers.1", "input"]},
                 {"step": 250, "active": []}]}})"),
                      "test.json");
  const auto c = layer_switching_from_json(reader);
  REQUIRE(c.type == SwitchingType::explicit_list);
  REQUIRE(c.policy == DeactivatePolicy::keep_device);
  REQUIRE(c.steps.size() == 3);
  REQUIRE(c.steps[0] == std::pair<std::int64_t, Names>{0, {"layers.0"}});
  REQUIRE(c.steps[1] == std::pair<std::int64_t, Names>{100, {"layers.1", "input"}});
  REQUIRE(c.steps[2] == std::pair<std::int64_t, Names>{250, {}});
  REQUIRE(reader.unread_keys().empty());
  const LayerSchedule schedule(c, model_groups(2));
  REQUIRE(schedule.active_at(120) == Names{"input", "layers.1", "head"});
  REQUIRE(schedule.active_at(250) == Names{"head"});
}

TEST_CASE("an unknown key inside a schedule entry is reported with its index") {
  ConfigReader reader(nlohmann::json::parse(R"({"layer_switching": {"type": "explicit",
    "schedule": [{"step": 0, "active": ["layers.0"]},
                 {"step": 5, "active": ["layers.1"], "note": "warm-up over"}]}})"),
                      "test.json");
  layer_switching_from_json(reader);
  REQUIRE(reader.unread_keys() == Names{"layer_switching.schedule[1].note"});
}

TEST_CASE("a badly typed layer_switching value is refused naming the key, index and file") {
  struct Bad {
    const char* json;
    const char* key;
  };
  const Bad cases[] = {
      {R"({"layer_switching": {"type": 5}})", "layer_switching.type"},
      {R"({"layer_switching": {"interval": "often"}})", "layer_switching.interval"},
      {R"({"layer_switching": {"gamma": 2.5}})", "layer_switching.gamma"},
      {R"({"layer_switching": {"gamma": 1e12}})", "layer_switching.gamma"},
      {R"({"layer_switching": {"seed": -1}})", "layer_switching.seed"},
      {R"({"layer_switching": {"layers": "layers.0"}})", "layer_switching.layers"},
      {R"({"layer_switching": {"always_active": ["input", 3]}})", "layer_switching.always_active"},
      {R"({"layer_switching": {"order": ["random"]}})", "layer_switching.order"},
      {R"({"layer_switching": {"policy": "forget"}})", "layer_switching.policy"},
      {R"({"layer_switching": {"schedule": {"step": 0}}})", "layer_switching.schedule"},
      {R"({"layer_switching": {"schedule": [{"step": 0, "active": []}, {"active": []}]}})",
       "layer_switching.schedule[1].step"},
      {R"({"layer_switching": {"schedule": [{"step": 0}]}})", "layer_switching.schedule[0].active"},
      {R"({"layer_switching": {"schedule": [{"step": 0, "active": []}, 7]}})",
       "layer_switching.schedule[1].step"},
      {R"({"layer_switching": {"schedule": [{"step": "0", "active": []}]}})",
       "layer_switching.schedule[0].step"},
      {R"({"layer_switching": {"schedule": [{"step": 0, "active": "input"}]}})",
       "layer_switching.schedule[0].active"},
  };
  for (const auto& c : cases) {
    const auto msg = json_error(c.json);
    CAPTURE(c.json, msg);
    REQUIRE(test::contains(msg, c.key));
    REQUIRE(test::contains(msg, "test.json"));
  }
}

// ---- validation ----------------------------------------------------------------------------

TEST_CASE("an unknown type is refused when read, naming the file and layer_switching.type") {
  REQUIRE(json_error(R"({"layer_switching": {"type": "galore"}})") ==
          "test.json: layer_switching.type = \"galore\": expected none, lisa, badam or explicit");
}

TEST_CASE("an unknown order is refused when read, naming the file and layer_switching.order") {
  REQUIRE(json_error(R"({"layer_switching": {"type": "badam", "order": "shuffled"}})") ==
          "test.json: layer_switching.order = \"shuffled\": expected ascending, descending or "
          "random");
}

TEST_CASE("every type and order name reads back as the name it was parsed from") {
  for (const char* name : {"none", "lisa", "badam", "explicit"})
    REQUIRE(std::string(switching_type_name(switching_type_from_name(name, "k"))) == name);
  for (const char* name : {"ascending", "descending", "random"})
    REQUIRE(std::string(block_order_name(block_order_from_name(name, "k"))) == name);
  // Names are exact: DeepSpeed-style configs spell them in lower case.
  REQUIRE(test::message_of<ConfigError>([] { switching_type_from_name("LISA", "k"); }) ==
          "k = \"LISA\": expected none, lisa, badam or explicit");
}

TEST_CASE("a layer that is not a group of the model is refused naming its index and the groups") {
  auto c = lisa(4, 2);
  c.layers[3] = "layers.99";
  const auto msg = schedule_error(c, 12);
  REQUIRE(test::contains(msg,
                         "layer_switching.layers[3] = \"layers.99\": not a group of the "
                         "model (groups: input, layers.0, ..., head (14 groups))"));
}

TEST_CASE("an always-active group that is not a group of the model is refused naming its index") {
  auto c = badam(4, BlockOrder::ascending);
  c.always_active = {"head", "embed"};
  REQUIRE(test::contains(schedule_error(c),
                         "layer_switching.always_active[1] = \"embed\": not a group of the model "
                         "(groups: input, layers.0, layers.1, layers.2, layers.3, head)"));
}

TEST_CASE("a layer listed twice is refused naming both places") {
  auto c = lisa(4, 2);
  c.layers = {"layers.0", "layers.1", "layers.0"};
  REQUIRE(test::contains(schedule_error(c),
                         "layer_switching.layers[2] = \"layers.0\": repeats layers[0]"));
}

TEST_CASE("an interval below 1 is refused naming layer_switching.interval") {
  auto c = lisa(4, 2);
  c.interval = 0;
  REQUIRE(test::contains(schedule_error(c), "layer_switching.interval = 0: must be >= 1"));
  auto b = badam(4, BlockOrder::ascending);
  b.interval = -3;
  REQUIRE(test::contains(schedule_error(b), "layer_switching.interval = -3: must be >= 1"));
}

TEST_CASE("a gamma below 1 is refused naming layer_switching.gamma") {
  REQUIRE(test::contains(schedule_error(lisa(4, 0)), "layer_switching.gamma = 0: must be >= 1"));
}

TEST_CASE("a gamma larger than the layers to sample from is refused naming layer_switching.gamma") {
  REQUIRE(test::contains(schedule_error(lisa(4, 5)),
                         "layer_switching.gamma = 5: larger than the 4 layers to sample from"));
}

TEST_CASE("a group both always active and in layers is refused naming both keys") {
  auto c = lisa(4, 2);
  c.always_active = {"input", "layers.1"};
  REQUIRE(test::contains(schedule_error(c),
                         "layer_switching.always_active[1] = \"layers.1\": also in "
                         "layer_switching.layers"));
}

TEST_CASE("LISA and BAdam without layers are refused naming layer_switching.layers") {
  auto c = lisa(4, 2);
  c.layers.clear();
  REQUIRE(test::contains(schedule_error(c), "layer_switching.layers = []: empty, but lisa"));
  auto b = badam(4, BlockOrder::ascending);
  b.layers.clear();
  REQUIRE(test::contains(schedule_error(b), "layer_switching.layers = []: empty, but badam"));
}

TEST_CASE("a schedule given to LISA or BAdam is refused, it would be ignored") {
  auto c = lisa(4, 2);
  c.steps = {{0, {"head"}}};
  REQUIRE(test::contains(schedule_error(c),
                         "layer_switching.schedule: only used by type "
                         "\"explicit\", not \"lisa\""));
}

TEST_CASE("layers given to an explicit schedule are refused, they would be ignored") {
  auto c = explicit_table();
  c.layers = {"layers.0"};
  REQUIRE(
      test::contains(schedule_error(c), "layer_switching.layers: not used by type \"explicit\""));
}

TEST_CASE("an empty explicit schedule is refused naming layer_switching.schedule") {
  auto c = explicit_table();
  c.steps.clear();
  REQUIRE(test::contains(schedule_error(c), "layer_switching.schedule: empty"));
}

TEST_CASE("an explicit schedule that does not start at step 0 is refused naming schedule[0]") {
  auto c = explicit_table();
  c.steps[0].first = 3;
  REQUIRE(test::contains(schedule_error(c), "layer_switching.schedule[0].step = 3: must be 0"));
}

TEST_CASE("explicit steps that do not increase are refused naming both entries") {
  auto c = explicit_table();
  c.steps = {{0, {"head"}}, {20, {"layers.0"}}, {10, {"layers.1"}}};
  REQUIRE(test::contains(schedule_error(c),
                         "layer_switching.schedule[2].step = 10: does not "
                         "come after schedule[1].step = 20"));
  c.steps = {{0, {"head"}}, {20, {"layers.0"}}, {20, {"layers.1"}}};
  REQUIRE(test::contains(schedule_error(c),
                         "layer_switching.schedule[2].step = 20: does not "
                         "come after schedule[1].step = 20"));
}

TEST_CASE("an explicit entry naming an unknown group is refused naming its indices") {
  auto c = explicit_table();
  c.steps[1].second = {"layers.1", "layers.7"};
  REQUIRE(test::contains(schedule_error(c),
                         "layer_switching.schedule[1].active[1] = \"layers.7\": "
                         "not a group of the model"));
}

TEST_CASE("an explicit entry that would train no group is refused naming it") {
  auto c = explicit_table();
  c.always_active.clear();
  c.steps[2].second.clear();
  REQUIRE(test::contains(schedule_error(c),
                         "layer_switching.schedule[2].active = []: empty, and so "
                         "is layer_switching.always_active"));
}

TEST_CASE("a negative step is refused by active_at and boundary") {
  const LayerSchedule schedule(lisa(4, 2), model_groups(4));
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { schedule.active_at(-1); }),
                         "LayerSchedule::active_at: step -1"));
  REQUIRE(test::contains(test::message_of<ConfigError>([&] { schedule.boundary(-1); }),
                         "LayerSchedule::boundary: step -1"));
}

TEST_CASE(
    "type none ignores the other layer_switching keys, so switching turns off by type alone") {
  auto c = lisa(4, 9);  // gamma too large: would be refused for lisa
  c.type = SwitchingType::none;
  const LayerSchedule schedule(c, model_groups(4));
  REQUIRE(schedule.active_at(3) == model_groups(4));
}

// ---- ConfigReader paths the section relies on ---------------------------------------------

TEST_CASE("a --set override can replace an element of a list by index") {
  ConfigReader reader(nlohmann::json::parse(R"({"layer_switching": {"type": "explicit",
    "schedule": [{"step": 0, "active": ["layers.0"]}, {"step": 5, "active": ["head"]}]}})"),
                      "test.json");
  reader.set("layer_switching.schedule[1].step=7");
  REQUIRE(layer_switching_from_json(reader).steps[1].first == 7);
  REQUIRE(test::contains(
      test::message_of<ConfigError>([&] { reader.set("layer_switching.schedule[2].step=9"); }),
      "schedule[2]"));
}

TEST_CASE("a --set override can create a section the config does not have") {
  ConfigReader reader(nlohmann::json::object(), "test.json");
  reader.set("layer_switching.type=badam");
  reader.set("layer_switching.layers=[\"layers.0\"]");
  const auto c = layer_switching_from_json(reader);
  REQUIRE(c.type == SwitchingType::badam);
  REQUIRE(c.layers == Names{"layers.0"});
}

// ---- size -----------------------------------------------------------------------------------

TEST_CASE("a schedule over 100,000 groups is checked and drawn in linear time, duplicates named") {
  // Each group was looked for among all the others (100,000 groups: 5e9 string comparisons for
  // the groups alone, more for each list); now by hash. The bound is far above the linear time
  // (1.2 s on a busy 2-core machine), even under the sanitizers.
  const int depth = 100000;
  LayerSwitchingConfig c;
  c.type = SwitchingType::lisa;
  c.gamma = 2;
  c.layers = body(depth);
  c.always_active = {"input", "head"};
  const auto start = std::chrono::steady_clock::now();
  const LayerSchedule lisa(c, model_groups(depth));
  const auto active = lisa.active_at(5);
  LayerSwitchingConfig e;
  e.type = SwitchingType::explicit_list;
  e.steps = {{0, body(depth)}};
  const LayerSchedule table(e, model_groups(depth));
  CHECK(table.active_at(0).size() == static_cast<std::size_t>(depth));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CAPTURE(seconds);
  CHECK(seconds < 10.0);
  CHECK(active.size() == 4);
  CHECK(active.front() == "input");
  CHECK(active.back() == "head");

  Names twice = model_groups(depth);
  twice.push_back("layers.123");
  CHECK(test::message_of<ConfigError>([&] { LayerSchedule(LayerSwitchingConfig{}, twice); }) ==
        "LayerSchedule: the model declares group 'layers.123' twice");
  c.layers.push_back("layers.7");
  CHECK(test::message_of<ConfigError>([&] { LayerSchedule(c, model_groups(depth)); }) ==
        "layer_switching.layers[100000] = \"layers.7\": repeats layers[7]");
}
