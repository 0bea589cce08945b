#include "cli/plot.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>

#include "shardswap/json_reader.h"
#include "shardswap/stats.h"
#include "files/output_file.h"

extern char** environ;

namespace shardswap {

namespace fs = std::filesystem;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr const char* kPackage = "gnuplot-nox";
// A line of metrics.jsonl is an object of numbers, a few hundred bytes, nested 3 deep; these
// bound what a hostile one costs.
constexpr JsonLimits kLineLimits{64, std::size_t{16} << 20, "a metrics line"};
// Distinct on white; gnuplot's default cycle has a yellow that barely shows.
constexpr std::array<const char*, 8> kColors = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                                                "#9467bd", "#8c564b", "#e377c2", "#17becf"};

// A line's known key: absent and null read as "no value"; any other non-number is malformed.
std::optional<double> number_at(const nlohmann::json& object, const char* key,
                                const std::string& where) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return std::nullopt;
  if (!it->is_number())
    throw ConfigError(fmt::format("plot: {}: '{}' must be a number or null, not {}", where, key,
                                  it->type_name()));
  return it->get<double>();
}

// Collects memory_bytes per key across lines; the order of the panel is decided at the end.
struct MemoryColumns {
  std::map<std::string, std::vector<double>> values;  // per key, one per line so far
  std::vector<std::string> first_seen;
  std::map<std::string, bool> non_zero;

  void add_line(const nlohmann::json* memory, std::size_t lines_before, const std::string& where) {
    if (memory) {
      for (const auto& [key, v] : memory->items()) {
        const bool known = key == "total" || key == "peak" || is_tag(key);
        if (v.is_null()) continue;
        if (!v.is_number()) {
          if (known)
            throw ConfigError(fmt::format("plot: {}: 'memory_bytes.{}' must be a number, not {}",
                                          where, key, v.type_name()));
          continue;  // an unknown non-numeric key is no tag: tolerated, not drawn
        }
        auto [it, inserted] = values.try_emplace(key, std::vector<double>(lines_before, kNaN));
        if (inserted) first_seen.push_back(key);
        it->second.push_back(v.get<double>() / 1048576.0);
        if (v.get<double>() != 0.0) non_zero[key] = true;
      }
    }
    for (auto& [key, column] : values)
      if (column.size() == lines_before) column.push_back(kNaN);
  }

  static bool is_tag(const std::string& key) {
    return std::any_of(kAllTags.begin(), kAllTags.end(), [&](Tag t) { return key == tag_name(t); });
  }

  std::vector<MemorySeries> series() const {
    std::vector<std::string> order;
    for (Tag t : kAllTags) order.push_back(tag_name(t));
    for (const auto& key : first_seen)
      if (!is_tag(key) && key != "total" && key != "peak") order.push_back(key);
    // A tag that never reaches kMinTagShare of the largest total draws a line on zero.
    double largest = 0.0;
    if (const auto total = values.find("total"); total != values.end())
      for (double v : total->second)
        if (std::isfinite(v)) largest = std::max(largest, v);
    const auto visible = [&](const std::string& key) {
      if (!non_zero.count(key)) return false;
      for (double v : values.at(key))
        if (std::isfinite(v) && v >= kMinTagShare * largest) return true;
      return false;
    };
    std::vector<MemorySeries> out;
    for (const auto& key : order)
      if (visible(key)) out.push_back({key, values.at(key)});
    if (values.count("total")) out.push_back({"total", values.at("total")});
    return out;
  }
};

}  // namespace

MetricsSeries read_metrics(std::istream& in, const std::string& source) {
  MetricsSeries s;
  // The lines that count, parsed, with where they came from: a resume line drops the lines it
  // supersedes before any is drawn.
  std::vector<std::pair<nlohmann::json, std::string>> lines;
  std::string text;
  for (std::int64_t number = 1; std::getline(in, text); ++number) {
    // getline stops at the end of the input without a '\n' only on the last line: a line whose
    // write a kill cut short, if it does not parse.
    const bool unterminated = in.eof();
    if (std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isspace(c); }))
      continue;
    std::string where = fmt::format("{} line {}", source, number);
    nlohmann::json line;
    try {
      line = parse_json(text, "", kLineLimits);
    } catch (const JsonError& e) {
      if (unterminated && e.kind() == JsonError::Kind::syntax) {
        s.warnings.push_back(fmt::format(
            "plot: {}: a cut-off last line (no newline, not valid JSON) skipped", where));
        break;
      }
      // Of "LINE:COLUMN" in a one-line text, the column is what says where.
      const auto column = e.column() == 0 ? "" : fmt::format(", column {}", e.column());
      const auto key = e.path().empty() ? "" : json_path_text(e.path()) + ": ";
      throw ConfigError(fmt::format("plot: {}{}: {}{}", where, column, key, e.reason()));
    }
    if (!line.is_object())
      throw ConfigError(
          fmt::format("plot: {}: expected a JSON object, got {}", where, line.type_name()));
    if (const auto resumed = line.find("resumed"); resumed != line.end()) {
      const auto at = resumed->is_object() ? resumed->find("step") : resumed->end();
      if (at == resumed->end() || !at->is_number_integer())
        throw ConfigError(
            fmt::format("plot: {}: 'resumed' must be an object with an integer 'step'", where));
      // The run went on from this step: what an earlier run logged after it is superseded.
      const auto step = at->get<std::int64_t>();
      std::erase_if(lines, [&](const auto& l) {
        return l.first.at("step").template get<std::int64_t>() > step;
      });
      s.resume_steps.push_back(step);
      continue;
    }
    const auto step = line.find("step");
    if (step == line.end() || !step->is_number_integer())
      throw ConfigError(fmt::format("plot: {}: 'step' must be an integer", where));
    lines.emplace_back(std::move(line), std::move(where));
  }
  if (in.bad()) throw ConfigError(fmt::format("plot: cannot read metrics file '{}'", source));

  MemoryColumns memory;
  for (const auto& [line, where] : lines) {
    s.steps.push_back(line.at("step").get<std::int64_t>());
    s.loss.push_back(number_at(line, "loss", where).value_or(kNaN));
    if (const auto v = number_at(line, "initial_val_loss", where)) s.val_loss.emplace_back(0, *v);
    if (const auto v = number_at(line, "val_loss", where))
      s.val_loss.emplace_back(s.steps.back(), *v);

    const auto mem = line.find("memory_bytes");
    if (mem != line.end() && !mem->is_null() && !mem->is_object())
      throw ConfigError(fmt::format("plot: {}: 'memory_bytes' must be an object, not {}", where,
                                    mem->type_name()));
    memory.add_line(mem != line.end() && mem->is_object() ? &*mem : nullptr, s.steps.size() - 1,
                    where);

    const auto sw = line.find("switch");
    if (sw != line.end() && !sw->is_null()) {
      if (!sw->is_object())
        throw ConfigError(
            fmt::format("plot: {}: 'switch' must be an object, not {}", where, sw->type_name()));
      s.switch_steps.push_back(s.steps.back());
      std::string in;
      if (const auto groups = sw->find("in"); groups != sw->end() && groups->is_array())
        for (const auto& g : *groups)
          if (g.is_string()) in += (in.empty() ? "" : ", ") + g.get<std::string>();
      s.switch_in.push_back(std::move(in));
    }
  }
  if (s.steps.empty())
    throw ConfigError(fmt::format("plot: metrics file '{}' holds no step", source));
  s.memory = memory.series();
  return s;
}

MetricsSeries read_metrics_file(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec))
    throw ConfigError(fmt::format("plot: metrics file '{}' is a directory", path));
  std::ifstream in(path);
  if (!in)
    throw ConfigError(
        fmt::format("plot: cannot read metrics file '{}': {}", path, std::strerror(errno)));
  return read_metrics(in, path);
}

PlotFormat plot_format(const std::string& out_path) {
  std::string ext = fs::path(out_path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (ext == ".png") return PlotFormat::png;
  if (ext == ".svg") return PlotFormat::svg;
  throw ConfigError(
      fmt::format("plot: --out '{}': unknown extension '{}'; use .png or .svg", out_path, ext));
}

namespace {

// A gnuplot single-quoted string: a quote is doubled, nothing else is special; control
// characters, which would end the line of the script, become spaces.
std::string quoted(const std::string& text) {
  std::string q = "'";
  for (char c : text) {
    if (c == '\'')
      q += "''";
    else
      q += static_cast<unsigned char>(c) < 0x20 ? ' ' : c;
  }
  return q + "'";
}

// gnuplot reads "?" as a missing value (set datafile missing).
std::string value(double v) {
  return std::isfinite(v) ? fmt::format("{}", v) : "?";
}

bool all_positive(const MetricsSeries& s) {
  bool any = false;
  for (double v : s.loss) {
    if (std::isnan(v)) continue;
    if (!(v > 0.0)) return false;
    any = true;
  }
  for (const auto& [step, v] : s.val_loss) {
    if (!(v > 0.0)) return false;
    any = true;
  }
  return any;
}

// A series built by hand (not by read_metrics) must still index safely.
void check_shape(const MetricsSeries& s) {
  if (s.steps.empty()) throw ConfigError("plot: no step to draw");
  bool ok = s.loss.size() == s.steps.size();
  for (const auto& m : s.memory) ok = ok && m.mib.size() == s.steps.size();
  if (!ok)
    throw ConfigError(
        fmt::format("plot: every series needs one value per step ({} steps)", s.steps.size()));
}

}  // namespace

void write_plot_data(const MetricsSeries& s, const std::string& folder) {
  check_shape(s);
  const auto write = [&](const char* name, const auto& fill) {
    const auto path = fs::path(folder) / name;
    std::ofstream f(path);
    fill(f);
    f.close();
    if (!f) throw Error(fmt::format("plot: cannot write '{}'", path.string()));
  };
  write("loss.dat", [&](std::ostream& f) {
    for (std::size_t i = 0; i < s.steps.size(); ++i)
      if (std::isfinite(s.loss[i])) f << s.steps[i] << ' ' << value(s.loss[i]) << '\n';
  });
  write("val_loss.dat", [&](std::ostream& f) {
    for (const auto& [step, v] : s.val_loss) f << step << ' ' << value(v) << '\n';
  });
  write("memory.dat", [&](std::ostream& f) {
    for (std::size_t i = 0; i < s.steps.size(); ++i) {
      f << s.steps[i];
      for (const auto& m : s.memory) f << ' ' << value(m.mib[i]);
      f << '\n';
    }
  });
}

std::string gnuplot_script(const MetricsSeries& s, PlotFormat format, bool log_y) {
  check_shape(s);
  if (log_y && !all_positive(s))
    throw ConfigError("plot: --log-y: the loss has values <= 0 (or none), which a log axis "
                      "cannot draw");
  std::int64_t lo = *std::min_element(s.steps.begin(), s.steps.end());
  const std::int64_t hi = *std::max_element(s.steps.begin(), s.steps.end());
  for (const auto& [step, v] : s.val_loss) lo = std::min(lo, step);  // step 0: before training
  // One x range for both panels, so that a step sits at the same column in each.
  const double x0 = static_cast<double>(lo) - (lo == hi ? 1.0 : 0.0);
  const double x1 = static_cast<double>(hi) + (lo == hi ? 1.0 : 0.0);
  const bool any_loss =
      std::any_of(s.loss.begin(), s.loss.end(), [](double v) { return std::isfinite(v); });
  std::string g =
      "# Written by shardswap plot. ARG1: output file, ARG2: data folder, ARG3: title.\n";
  if (format == PlotFormat::svg) {
    g += "set terminal svg size 1000,800 dynamic background rgb 'white'\n";
  } else {
    // pngcairo draws antialiased lines; the gd-based png terminal is what some builds have.
    g += "if (strstrt(GPVAL_TERMINALS, ' pngcairo ') > 0) {\n"
         "  set terminal pngcairo size 1000,800\n"
         "} else {\n"
         "  set terminal png size 1000,800\n"
         "}\n";
  }
  // Enhanced text would turn the '_' of optim_state or val_loss into a subscript.
  g += "set termoption noenhanced\n"
       "set output ARG1\n"
       "set datafile missing '?'\n"
       "set multiplot layout 2,1 title ARG3\n";
  g += fmt::format("set xrange [{}:{}]\n", x0, x1);
  // Fixed margins keep the two panels' x axes aligned whatever their key widths.
  g += "set lmargin at screen 0.09\nset rmargin at screen 0.78\n"
       "set key outside right top\nset grid\n";
  for (std::int64_t step : s.switch_steps)
    g += fmt::format(
        "set arrow from first {0}, graph 0 to first {0}, graph 1 nohead dt 2 lc rgb '#808080'\n",
        step);
  const std::string switch_key =
      s.switch_steps.empty() ? "" : ", NaN with lines dt 2 lc rgb '#808080' title 'layer switch'";
  // Each switch's line in the loss panel says which groups came in.
  for (std::size_t i = 0; i < s.switch_steps.size() && i < s.switch_in.size(); ++i)
    if (!s.switch_in[i].empty())
      g += fmt::format(
          "set label {} {} at first {}, graph 0.97 rotate by 90 right offset -0.5,0 "
          "font ',8' tc rgb '#606060'\n",
          100 + i, quoted("in: " + s.switch_in[i]), s.switch_steps[i]);

  // (a) loss and val_loss, on a linear axis with gnuplot's round ticks; a log axis (--log-y)
  // shows the late, slow part of a falling loss.
  if (log_y)
    g += "set logscale y\nset ylabel 'loss (log scale)'\n";
  else
    g += "set ylabel 'loss'\n";
  std::vector<std::string> plots;
  if (any_loss)
    plots.push_back("ARG2.'/loss.dat' using 1:2 with lines lw 1.5 lc rgb '#1f77b4' title 'loss'");
  if (!s.val_loss.empty())
    plots.push_back(
        "ARG2.'/val_loss.dat' using 1:2 with linespoints pt 7 ps 0.7 lw 1.5 lc rgb '#d62728' "
        "title 'val_loss'");
  if (plots.empty()) {
    g += "set label 1 'no loss in the metrics' at graph 0.5, 0.5 center\n";
    plots.push_back("NaN notitle");
  }
  g += "plot ";
  for (std::size_t i = 0; i < plots.size(); ++i) g += (i ? ", " : "") + plots[i];
  g += switch_key + "\n";
  g += "unset label\nunset logscale y\n";  // the switches' labels too: the loss panel's

  // (b) memory by tag. Memory changes at a step boundary (a switch) and holds until the next:
  // steps, not a slope between two measurements.
  g += "set xlabel 'step'\nset ylabel 'memory (MiB)'\n";
  if (s.memory.empty()) {
    g += "set label 1 'no memory_bytes in the metrics' at graph 0.5, 0.5 center\n"
         "plot NaN notitle\n";
  } else {
    g += "plot ";
    for (std::size_t i = 0; i < s.memory.size(); ++i) {
      const bool total = s.memory[i].name == "total";
      g += fmt::format("{}ARG2.'/memory.dat' using 1:{} with steps lw {} lc rgb '{}' title {}",
                       i ? ", " : "", i + 2, total ? 2.5 : 1.5,
                       total ? "black" : kColors[i % kColors.size()], quoted(s.memory[i].name));
    }
    g += "\n";
  }
  g += "unset multiplot\nset output\n";
  return g;
}

namespace {

// A folder removed with everything in it when the scope ends.
class TempFolder {
 public:
  TempFolder() {
    auto pattern = (fs::temp_directory_path() / "shardswap-plot-XXXXXX").string();
    if (!mkdtemp(pattern.data()))
      throw Error(fmt::format("plot: cannot create a temporary folder '{}': {}", pattern,
                              std::strerror(errno)));
    path_ = pattern;
  }
  ~TempFolder() {
    std::error_code ec;
    fs::remove_all(path_, ec);  // best effort: a leftover temp folder is no reason to fail
  }
  TempFolder(const TempFolder&) = delete;
  TempFolder& operator=(const TempFolder&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string tail_of_file(const fs::path& path, std::size_t max_chars) {
  std::ifstream f(path);
  std::stringstream text;
  text << f.rdbuf();
  auto s = text.str();
  if (s.size() > max_chars) s = "..." + s.substr(s.size() - max_chars);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// Runs `argv` with stdout and stderr into `log`; returns its wait status. Spawned directly, not
// through a shell, so that no argument is ever interpreted.
int run_program(const std::vector<std::string>& argv, const fs::path& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc == ENOENT)
    throw ToolNotFound(fmt::format(
        "plot: '{}' is not installed (not found on PATH); install the Debian/Ubuntu package {} "
        "(sudo apt-get install {}, or bash tools/install-deps.sh)",
        argv[0], kPackage, kPackage));
  if (rc != 0) throw Error(fmt::format("plot: cannot run '{}': {}", argv[0], std::strerror(rc)));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR)
      throw Error(fmt::format("plot: waiting for '{}': {}", argv[0], std::strerror(errno)));
  }
  return status;
}

}  // namespace

void plot_metrics(const MetricsSeries& series, const std::string& out_path,
                  const PlotOptions& options) {
  const PlotFormat format = plot_format(out_path);
  OutputFile out("--out", out_path, options.inputs);

  const TempFolder temp;
  write_plot_data(series, temp.path().string());
  const auto script = temp.path() / "plot.gp";
  {
    std::ofstream f(script);
    f << gnuplot_script(series, format, options.log_y);
    f.close();
    if (!f) throw Error(fmt::format("plot: cannot write '{}'", script.string()));
  }
  // gnuplot draws into the temporary beside the output, renamed over it only once it succeeded.
  const fs::path partial = out.temporary();
  const auto log = temp.path() / "gnuplot.log";
  const int status = run_program({options.gnuplot, "-c", script.string(), partial.string(),
                                  temp.path().string(), options.title},
                                 log);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    const std::string how = WIFEXITED(status)
                                ? fmt::format("exited with status {}", WEXITSTATUS(status))
                                : fmt::format("was killed by signal {}", WTERMSIG(status));
    throw Error(fmt::format("plot: {} {} drawing '{}':\n{}", options.gnuplot, how, out_path,
                            tail_of_file(log, 2000)));
  }
  std::error_code ec;
  if (!fs::is_regular_file(partial, ec) || fs::file_size(partial, ec) == 0)
    throw Error(fmt::format("plot: {} exited 0 but wrote nothing for '{}':\n{}", options.gnuplot,
                            out_path, tail_of_file(log, 2000)));
  out.commit();
}

int plot_command(const std::vector<std::string>& args, std::ostream& out) {
  std::string metrics, out_path;
  bool log_y = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--log-y") {
      log_y = true;
    } else if (args[i] == "--out") {
      if (i + 1 >= args.size()) throw ConfigError("plot: --out needs a value");
      out_path = args[++i];
    } else if (args[i].starts_with("--")) {
      throw ConfigError(fmt::format("plot: unknown argument '{}'", args[i]));
    } else if (metrics.empty()) {
      metrics = args[i];
    } else {
      throw ConfigError(
          fmt::format("plot: one METRICS file only, got '{}' and '{}'", metrics, args[i]));
    }
  }
  if (metrics.empty()) throw ConfigError("plot: needs a METRICS file (shardswap train --metrics)");
  if (out_path.empty()) throw ConfigError("plot: needs --out FILE.png or --out FILE.svg");
  plot_format(out_path);  // a bad --out is named before the metrics are read
  PlotOptions options;
  options.log_y = log_y;
  options.inputs = {{"the metrics file", metrics}};
  check_output_path("--out", out_path, options.inputs);
  const auto series = read_metrics_file(metrics);
  for (const auto& warning : series.warnings)
    std::cerr << "shardswap: warning: " << warning << "\n";
  options.title = fmt::format("shardswap plot: {}", fs::path(metrics).filename().string());
  plot_metrics(series, out_path, options);
  out << fmt::format("plot: wrote {} ({} steps, {} layer switches)\n", out_path,
                     series.steps.size(), series.switch_steps.size());
  return 0;
}

}  // namespace shardswap
