// Specification of memory/: stats in the c10 vocabulary, registered aliases, stale Views, Pins.
#include <random>
#include <vector>

#include "memory/host_types.h"
#include "shardswap/buffer.h"
#include "shardswap/error.h"
#include "tests/catch_compat.h"

using namespace shardswap;

namespace {

MemorySpace host_space(int rank = 0) {
  return MemorySpace(rank, make_host_allocator());
}

void require_all_zero(const MemoryStats& s) {
  for (Tag t : kAllTags) {
    CAPTURE(tag_name(t));
    REQUIRE(s.tag(t).requested.current == 0);
    REQUIRE(s.tag(t).requested.peak == 0);
    REQUIRE(s.tag(t).allocated.current == 0);
    REQUIRE(s.tag(t).allocated.peak == 0);
    REQUIRE(s.tag(t).buffers == 0);
  }
  REQUIRE(s.requested.current == 0);
  REQUIRE(s.requested.peak == 0);
  REQUIRE(s.allocated.current == 0);
  REQUIRE(s.allocated.peak == 0);
  REQUIRE(s.reserved.current == 0);
  REQUIRE(s.reserved.peak == 0);
  REQUIRE(s.buffers == 0);
  REQUIRE(s.views == 0);
  REQUIRE(s.pins == 0);
}

}  // namespace

TEST_CASE("an allocation is counted as requested, allocated and reserved under its tag") {
  MemorySpace space(3, make_host_allocator(256));
  Buffer b = space.allocate(1000, Tag::master32, "master");
  const auto s = space.stats();
  REQUIRE(s.rank == 3);
  REQUIRE(s.tag(Tag::master32).requested.current == 1000);
  REQUIRE(s.tag(Tag::master32).allocated.current == 1024);  // rounded to the 256-byte granularity
  REQUIRE(s.tag(Tag::grad).requested.current == 0);
  REQUIRE(s.requested.current == 1000);
  REQUIRE(s.allocated.current == 1024);
  REQUIRE(s.reserved.current == 1024);
  REQUIRE(s.buffers == 1);
}

TEST_CASE("peaks remember the largest total until reset_peaks") {
  auto space = host_space();
  {
    Buffer a = space.allocate(4096, Tag::grad, "a");
    Buffer b = space.allocate(4096, Tag::grad, "b");
  }
  Buffer c = space.allocate(512, Tag::param16, "c");
  auto s = space.stats();
  REQUIRE(s.tag(Tag::grad).requested.peak == 8192);
  REQUIRE(s.tag(Tag::grad).requested.current == 0);
  REQUIRE(s.requested.peak == 8192);
  REQUIRE(s.requested.current == 512);
  space.reset_peaks();
  s = space.stats();
  REQUIRE(s.requested.peak == 512);
  REQUIRE(s.tag(Tag::grad).requested.peak == 0);
}

TEST_CASE("creating and releasing 10000 buffers and views leaves every stat at exactly zero") {
  auto space = host_space();
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::size_t> size(1, 1 << 16);
  std::vector<Buffer> buffers;
  std::vector<View> views;
  for (int i = 0; i < 10000; ++i) {
    const Tag tag = kAllTags[static_cast<std::size_t>(i) % kTagCount];
    buffers.push_back(space.allocate(size(rng), tag, "b" + std::to_string(i)));
    views.push_back(
        buffers.back().view(0, buffers.back().bytes() / 4, DType::f32, "v" + std::to_string(i)));
    if (i % 3 == 0) views.push_back(views.back().sub(0, views.back().count() / 2, "sub"));
  }
  REQUIRE(space.stats().buffers == 10000);
  REQUIRE(space.stats().views >= 10000);
  // Release half by the owner first (their views turn stale), the rest by destruction.
  for (std::size_t i = 0; i < buffers.size(); i += 2) buffers[i].release("test release");
  buffers.clear();
  views.clear();
  space.reset_peaks();
  require_all_zero(space.stats());
}

TEST_CASE("a view used after its buffer was released raises StaleView naming it and the event") {
  auto space = host_space();
  Buffer b = space.allocate(64, Tag::param16, "group layers.3 param16");
  View v = b.view(0, 32, DType::bf16, "layers.3.fc1.weight: weight view");
  v.data<bf16_t>()[0] = bf16_t(1.5f);
  REQUIRE(float(v.data<bf16_t>()[0]) == 1.5f);
  b.release("re-form of group layers.3");
  REQUIRE(v.stale());
  const auto msg = test::message_of<StaleView>([&] { (void)v.data<bf16_t>(); });
  REQUIRE(test::contains(msg, "layers.3.fc1.weight: weight view"));
  REQUIRE(test::contains(msg, "re-form of group layers.3"));
  REQUIRE(space.stats().requested.current == 0);
}

TEST_CASE("a view of a buffer destroyed without an explicit release is stale too") {
  auto space = host_space();
  View v;
  {
    Buffer b = space.allocate(64, Tag::grad, "bucket 0");
    v = b.view(0, 16, DType::f32, "grad bucket 0 slot");
  }
  const auto msg = test::message_of<StaleView>([&] { (void)v.raw(); });
  REQUIRE(test::contains(msg, "grad bucket 0 slot"));
  REQUIRE(test::contains(msg, "Buffer destroyed"));
}

TEST_CASE("a view checks its element type") {
  auto space = host_space();
  Buffer b = space.allocate(64, Tag::grad, "g");
  View v = b.view(0, 16, DType::f32, "fp32 view");
  const auto msg = test::message_of<Error>([&] { (void)v.data<bf16_t>(); });
  REQUIRE(test::contains(msg, "fp32 view"));
  REQUIRE(test::contains(msg, "bf16"));
}

TEST_CASE("a view that does not fit its buffer is refused") {
  auto space = host_space();
  Buffer b = space.allocate(64, Tag::grad, "g");
  REQUIRE(test::contains(test::message_of<Error>([&] { b.view(32, 9, DType::f32, "too long"); }),
                         "too long"));
  REQUIRE(test::contains(test::message_of<Error>([&] { b.view(2, 1, DType::f32, "misaligned"); }),
                         "misaligned"));
  REQUIRE(space.stats().views == 0);
}

TEST_CASE("the registry lists every live alias of a buffer and forgets dropped ones") {
  auto space = host_space();
  Buffer b = space.allocate(256, Tag::param16, "flat");
  View w = b.view(0, 64, DType::bf16, "w view");
  {
    View copy = w;  // copies share one registration
    View g = b.view(128, 64, DType::bf16, "g view");
    Pin p = b.pin("trainer cache");
    REQUIRE(b.view_labels() == std::vector<std::string>{"w view", "g view"});
    REQUIRE(b.pin_labels() == std::vector<std::string>{"trainer cache"});
    const auto report = space.report();
    REQUIRE(report.size() == 1);
    REQUIRE(report[0].label == "flat");
    REQUIRE(report[0].tag == Tag::param16);
    REQUIRE(report[0].requested == 256);
    REQUIRE(report[0].views.size() == 2);
    REQUIRE(report[0].pins == std::vector<std::string>{"trainer cache"});
    REQUIRE(test::contains(space.report_text(), "pin:  trainer cache"));
    REQUIRE(space.stats().views == 2);
    REQUIRE(space.stats().pins == 1);
  }
  REQUIRE(b.view_labels() == std::vector<std::string>{"w view"});
  REQUIRE(space.stats().views == 1);
  REQUIRE(space.stats().pins == 0);
}

TEST_CASE("releasing a pinned buffer fails, names the pins and changes nothing") {
  auto space = host_space();
  Buffer b = space.allocate(512, Tag::master32, "master layers.0");
  View v = b.view(0, 128, DType::f32, "master view");
  Pin p = b.pin("user pin: layers.0 weights");
  const auto msg = test::message_of<PinnedMemory>([&] { b.release("deactivate layers.0"); });
  REQUIRE(test::contains(msg, "user pin: layers.0 weights"));
  REQUIRE(test::contains(msg, "master layers.0"));
  REQUIRE(b.valid());
  REQUIRE_FALSE(v.stale());
  REQUIRE(space.stats().requested.current == 512);
}

TEST_CASE("an allowed release of a pinned buffer reports the bytes the pins still hold") {
  auto space = host_space();
  Buffer b = space.allocate(512, Tag::master32, "master layers.0");
  View v = b.view(0, 128, DType::f32, "master view");
  Pin p = b.pin("user pin");
  REQUIRE(b.release("deactivate layers.0", ReleasePolicy::allow_pinned) == 512);
  REQUIRE(v.stale());
  REQUIRE(space.stats().requested.current == 512);  // still held, visibly
  const auto report = space.report();
  REQUIRE(report.size() == 1);
  REQUIRE_FALSE(report[0].owned);
  REQUIRE(report[0].pins == std::vector<std::string>{"user pin"});
  p.reset();
  REQUIRE(space.stats().requested.current == 0);
  REQUIRE(space.report().empty());
}

TEST_CASE("a pinned buffer replaced by move-assignment is released as the destructor would") {
  auto space = host_space();
  Buffer b = space.allocate(512, Tag::grad, "grad layers.0");
  View v = b.view(0, 128, DType::f32, "grad view");
  Pin p = b.pin("user pin");
  b = space.allocate(256, Tag::grad, "grad layers.1");  // noexcept, pinned or not
  REQUIRE(b.label() == "grad layers.1");
  REQUIRE(v.stale());
  REQUIRE(test::contains(test::message_of<StaleView>([&] { (void)v.raw(); }),
                         "Buffer replaced by assignment"));
  REQUIRE(space.stats().requested.current == 512 + 256);  // the Pin still holds the old block
  p.reset();
  REQUIRE(space.stats().requested.current == 256);
  b = Buffer();
  REQUIRE(space.stats().requested.current == 0);
}

TEST_CASE("buffers views and pins may outlive their memory space") {
  View v;
  Pin p;
  {
    auto space = host_space();
    Buffer b = space.allocate(64, Tag::other, "b");
    v = b.view(0, 4, DType::f32, "v");
    p = b.pin("p");
  }
  REQUIRE(v.stale());
  REQUIRE(p.bytes() == 64);
}

TEST_CASE("a zero-byte buffer is counted but takes no memory") {
  auto space = host_space();
  Buffer b = space.allocate(0, Tag::optim_state, "no momentum");
  REQUIRE(b.valid());
  REQUIRE(space.stats().buffers == 1);
  REQUIRE(space.stats().allocated.current == 0);
  b.release("done");
  REQUIRE(space.stats().buffers == 0);
}

TEST_CASE("invalidating a buffer's views makes older views stale and leaves newer ones usable") {
  auto space = host_space();
  Buffer b = space.allocate(64, Tag::grad, "grad bucket 0");
  View old_slot = b.view(0, 8, DType::f32, "layers.1.w: grad slot");
  View old_sub = old_slot.sub(0, 4, "part of slot");
  b.invalidate_views("bucket 0 reduced");
  View new_slot = b.view(0, 8, DType::f32, "layers.0.w: grad slot");
  REQUIRE(old_slot.stale());
  REQUIRE(old_sub.stale());
  const auto msg = test::message_of<StaleView>([&] { (void)old_slot.data<float>(); });
  REQUIRE(test::contains(msg, "layers.1.w: grad slot"));
  REQUIRE(test::contains(msg, "bucket 0 reduced"));
  REQUIRE_FALSE(new_slot.stale());
  new_slot.data<float>()[0] = 2.0f;
  REQUIRE(static_cast<float*>(b.data())[0] == 2.0f);
}

TEST_CASE("a space's cap refuses the allocation that would pass it, naming it, and allocates "
          "nothing") {
  auto space = host_space(3);
  REQUIRE(space.limit() == -1);
  space.set_limit(1000, "a device budget of 1000 bytes");
  REQUIRE(space.limit() == 1000);
  Buffer a = space.allocate(600, Tag::grad, "gradient partition");
  Buffer b = space.allocate(400, Tag::master32, "masters");  // exactly at the cap: allowed
  const auto before = space.stats();
  const std::string msg =
      test::message_of<OutOfMemory>([&] { (void)space.allocate(1, Tag::optim_state, "adam m"); });
  CAPTURE(msg);
  for (const char* part : {"rank 3", "'adam m'", "1 bytes", "optim_state", "would hold 1001 bytes",
                           "cap of 1000 bytes", "a device budget of 1000 bytes",
                           "nothing allocated", "gradient partition"})
    REQUIRE(msg.find(part) != std::string::npos);
  const auto after = space.stats();
  REQUIRE(after.requested.current == before.requested.current);
  REQUIRE(after.buffers == before.buffers);
  REQUIRE(after.tag(Tag::optim_state).buffers == 0);
  // Freed bytes make room again; a zero-byte buffer always fits; no cap, no refusal.
  a.release("test release");
  Buffer c = space.allocate(600, Tag::optim_state, "adam m");
  Buffer empty = space.allocate(0, Tag::other, "empty");
  REQUIRE_THROWS_AS(space.allocate(1, Tag::other, "one more"), OutOfMemory);
  space.set_limit(-5, "");
  REQUIRE(space.limit() == -1);
  Buffer d = space.allocate(4096, Tag::other, "uncapped");
  REQUIRE(space.stats().requested.current == 400 + 600 + 4096);
}
