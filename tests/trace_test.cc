#include "bench/trace.h"

#include <gtest/gtest.h>

namespace kvtier {
namespace {

const char* kTrace = KVTIER_SOURCE_DIR "/bench/traces/conversation_trace.jsonl";

TEST(Trace, ParsesAValidLine) {
  auto r = ParseTraceLine(
      R"({"timestamp": 27, "input_length": 1025, "output_length": 9, "hash_ids": [4, 5, 6]})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->timestamp_ms, 27u);
  EXPECT_EQ(r->input_length, 1025u);
  EXPECT_EQ(r->hash_ids, (std::vector<uint64_t>{4, 5, 6}));
}

TEST(Trace, RejectsBadLinesNamingTheProblem) {
  struct Case {
    const char* line;
    const char* needle;
  } cases[] = {
      {"not json", "not valid JSON"},
      {"[1,2]", "not a JSON object"},
      {R"({"input_length": 1, "output_length": 1, "hash_ids": [1]})", "timestamp"},
      {R"({"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]})", "timestamp"},
      {R"({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1, 2]})", "needs 1"},
      {R"({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": ["a"]})",
       "non-negative integers"},
      {R"({"timestamp": 0, "input_length": 99999999999, "output_length": 1, "hash_ids": []})",
       "input_length"},
      {R"({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": 3})", "hash_ids"},
  };
  for (const auto& c : cases) {
    auto r = ParseTraceLine(c.line);
    ASSERT_FALSE(r.ok()) << c.line;
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos) << r.status().message();
  }
}

TEST(Trace, ReadTraceNamesTheLine) {
  std::string path = ::testing::TempDir() + "/kvtier_bad_trace.jsonl";
  FILE* f = std::fopen(path.c_str(), "w");
  std::fputs(R"({"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]})"
             "\n\n{oops}\n",
             f);
  std::fclose(f);
  auto r = ReadTrace(path);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(":3:"), std::string::npos) << r.status().message();
  EXPECT_EQ(ReadTrace(path + ".missing").status().code(), absl::StatusCode::kNotFound);
}

// The reference figures of the shipped trace (bench/traces/README.md).
TEST(Trace, SharedCacheFiguresMatchThePublishedOnes) {
  auto trace = ReadTrace(kTrace);
  ASSERT_TRUE(trace.ok()) << trace.status();
  EXPECT_EQ(trace->size(), 12031u);
  auto inf = SharedPrefixCache(*trace, 0);
  EXPECT_NEAR(inf.block_hit_ratio(), 0.3664, 0.0001);
  EXPECT_NEAR(inf.token_hit_ratio(), 0.3736, 0.0001);
  EXPECT_NEAR(SharedPrefixCache(*trace, 10000).block_hit_ratio(), 0.211, 0.0005);
  EXPECT_NEAR(SharedPrefixCache(*trace, 50000).block_hit_ratio(), 0.355, 0.0005);
}

}  // namespace
}  // namespace kvtier
