//! The command line: every flag declared once in [`FLAGS`] (name, default, help), parsed
//! into a validated [`RouterConfig`].

use std::collections::HashMap;
use std::fmt::Display;
use std::str::FromStr;
use std::time::Duration;

use crate::policy::{CacheAwareThresholds, PolicyKind};
use crate::worker::WorkerUrl;

/// One command-line flag.
#[derive(Debug)]
struct Flag {
    /// The flag as typed, e.g. `--port`.
    name: &'static str,
    /// The placeholder for its value in the usage text.
    value_name: &'static str,
    /// The value used when the flag is not given; `None` for optional and repeated flags.
    default: Option<&'static str>,
    /// Whether the flag may be given more than once (each value counts).
    repeatable: bool,
    /// One line for the usage text.
    help: &'static str,
}

/// Every flag the router takes.
const FLAGS: &[Flag] = &[
    Flag {
        name: "--host",
        value_name: "HOST",
        default: Some("127.0.0.1"),
        repeatable: false,
        help: "address to listen on",
    },
    Flag {
        name: "--port",
        value_name: "PORT",
        default: Some("8000"),
        repeatable: false,
        help: "port to listen on (0: any free port, printed at start-up)",
    },
    Flag {
        name: "--worker",
        value_name: "URL",
        default: None,
        repeatable: true,
        help: "an OpenAI-compatible worker's base URL, http://host:port[/prefix]",
    },
    Flag {
        name: "--policy",
        value_name: "POLICY",
        default: Some("cache_aware"),
        repeatable: false,
        help: "cache_aware, round_robin or least_load",
    },
    Flag {
        name: "--cache-threshold",
        value_name: "FRACTION",
        default: Some("0.5"),
        repeatable: false,
        help: "cache_aware: a prefix match above this fraction of the key is a hit",
    },
    Flag {
        name: "--balance-abs-threshold",
        value_name: "REQUESTS",
        default: Some("32"),
        repeatable: false,
        help: "cache_aware: loads are imbalanced when max - min exceeds this...",
    },
    Flag {
        name: "--balance-rel-threshold",
        value_name: "RATIO",
        default: Some("1.5"),
        repeatable: false,
        help: "...and max exceeds min times this; then the least-loaded worker wins",
    },
    Flag {
        name: "--max-tree-chars",
        value_name: "CHARS",
        default: Some("2000000"),
        repeatable: false,
        help: "cache_aware: chars of routed keys remembered per worker (LRU beyond)",
    },
    Flag {
        name: "--health-interval",
        value_name: "SECONDS",
        default: Some("1.0"),
        repeatable: false,
        help: "seconds between GET /health checks of each worker",
    },
    Flag {
        name: "--request-timeout",
        value_name: "SECONDS",
        default: Some("600"),
        repeatable: false,
        help: "seconds a worker may take to answer, and may stay silent mid-stream",
    },
    Flag {
        name: "--shutdown-timeout",
        value_name: "SECONDS",
        default: Some("30"),
        repeatable: false,
        help: "on SIGTERM or Ctrl-C: seconds requests in flight may run on before being closed",
    },
    Flag {
        name: "--max-retries",
        value_name: "N",
        default: Some("2"),
        repeatable: false,
        help: "other workers to try when one fails before answering",
    },
    Flag {
        name: "--api-key",
        value_name: "KEY",
        default: None,
        repeatable: false,
        help: "bearer token for the router's own health checks (clients' Authorization \
               headers pass through untouched)",
    },
];

/// The router's settings, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    /// Address to listen on.
    pub host: String,
    /// Port to listen on; 0 picks a free one.
    pub port: u16,
    /// The workers at start-up (more can be added at run time).
    pub workers: Vec<WorkerUrl>,
    /// The routing policy.
    pub policy: PolicyKind,
    /// The thresholds of `cache_aware`.
    pub thresholds: CacheAwareThresholds,
    /// Chars remembered per worker tree.
    pub max_tree_chars: usize,
    /// Time between health checks.
    pub health_interval: Duration,
    /// Longest wait for a worker's response head, and for each chunk after it.
    pub request_timeout: Duration,
    /// How long requests in flight may run on after a shutdown signal.
    pub shutdown_timeout: Duration,
    /// Other workers tried after a failure before the response head.
    pub max_retries: usize,
    /// Bearer token for the router's own requests to workers (health checks).
    pub api_key: Option<String>,
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// Run the router.
    Run(RouterConfig),
    /// Print the usage text and exit.
    Help,
}

/// Parses the arguments after the program name.
pub fn parse_args<I: IntoIterator<Item = String>>(args: I) -> Result<Command, String> {
    let mut name_to_values: HashMap<&'static str, Vec<String>> = HashMap::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "--help" || arg == "-h" {
            return Ok(Command::Help);
        }
        let (name, inline_value) = match arg.split_once('=') {
            Some((name, value)) => (name.to_string(), Some(value.to_string())),
            None => (arg, None),
        };
        let Some(flag) = FLAGS.iter().find(|flag| flag.name == name) else {
            return Err(format!("unknown argument '{name}' (see --help)"));
        };
        let Some(value) = inline_value.or_else(|| args.next()) else {
            return Err(format!("{name} needs a value ({})", flag.value_name));
        };
        let values = name_to_values.entry(flag.name).or_default();
        if !flag.repeatable && !values.is_empty() {
            return Err(format!("{name} was given twice"));
        }
        values.push(value);
    }
    let values = FlagValues { name_to_values };
    let config = RouterConfig {
        host: values.one("--host")?,
        port: values.one("--port")?,
        workers: values
            .all("--worker")
            .iter()
            .map(|url| WorkerUrl::parse(url))
            .collect::<Result<_, _>>()?,
        policy: values.one("--policy")?,
        thresholds: CacheAwareThresholds {
            cache_threshold: values.fraction("--cache-threshold")?,
            balance_abs_threshold: values.one("--balance-abs-threshold")?,
            balance_rel_threshold: values.ratio_at_least_one("--balance-rel-threshold")?,
        },
        max_tree_chars: values.positive("--max-tree-chars")?,
        health_interval: values.seconds("--health-interval")?,
        request_timeout: values.seconds("--request-timeout")?,
        shutdown_timeout: values.seconds("--shutdown-timeout")?,
        max_retries: values.one("--max-retries")?,
        api_key: values.text("--api-key"),
    };
    Ok(Command::Run(config))
}

/// The usage text, generated from [`FLAGS`].
pub fn usage() -> String {
    let mut text = String::from(
        "usage: pagedrs-router --worker URL [--worker URL ...] [options]\n\n\
         Routes OpenAI-compatible requests to workers, preferring the one that most likely\n\
         has the prompt's prefix cached.\n\noptions:\n",
    );
    for flag in FLAGS {
        let default = flag.default.map(|value| format!(" (default {value})")).unwrap_or_default();
        let repeat = if flag.repeatable { " [repeatable]" } else { "" };
        text.push_str(&format!(
            "  {} {}{repeat}\n      {}{default}\n",
            flag.name, flag.value_name, flag.help
        ));
    }
    text.push_str(
        "  -h, --help\n      print this text\n\n\
         PAGEDRS_ROUTER_LOG=debug prints each routing decision to stderr.\n",
    );
    text
}

/// The values given for each flag, with [`FLAGS`]' defaults behind them.
struct FlagValues {
    /// Values by flag name, in the order given.
    name_to_values: HashMap<&'static str, Vec<String>>,
}

impl FlagValues {
    /// The text of `name`: the value given, else its default (`None` if it has none).
    fn text(&self, name: &str) -> Option<String> {
        self.name_to_values.get(name).and_then(|values| values.last()).cloned().or_else(|| {
            FLAGS
                .iter()
                .find(|flag| flag.name == name)
                .and_then(|flag| flag.default.map(String::from))
        })
    }

    /// The value of `name` parsed as `T`.
    fn one<T>(&self, name: &str) -> Result<T, String>
    where
        T: FromStr,
        T::Err: Display,
    {
        let text = self.text(name).ok_or_else(|| format!("{name} is required"))?;
        text.parse().map_err(|error| format!("{name} {text}: {error}"))
    }

    /// Every value given for the repeatable flag `name`.
    fn all(&self, name: &str) -> &[String] {
        self.name_to_values.get(name).map(Vec::as_slice).unwrap_or(&[])
    }

    /// The value of `name` as a number from 0 to 1.
    fn fraction(&self, name: &str) -> Result<f64, String> {
        let value: f64 = self.one(name)?;
        if !(0.0..=1.0).contains(&value) {
            return Err(format!("{name} {value}: must be between 0 and 1"));
        }
        Ok(value)
    }

    /// The value of `name` as a finite ratio of at least 1.
    fn ratio_at_least_one(&self, name: &str) -> Result<f64, String> {
        let value: f64 = self.one(name)?;
        if !(value.is_finite() && value >= 1.0) {
            return Err(format!("{name} {value}: must be a number of at least 1"));
        }
        Ok(value)
    }

    /// The value of `name` as a count above 0.
    fn positive(&self, name: &str) -> Result<usize, String> {
        let value: usize = self.one(name)?;
        if value == 0 {
            return Err(format!("{name} must be above 0"));
        }
        Ok(value)
    }

    /// The value of `name` as a duration in (fractional) seconds above 0.
    fn seconds(&self, name: &str) -> Result<Duration, String> {
        let value: f64 = self.one(name)?;
        match Duration::try_from_secs_f64(value) {
            Ok(duration) if !duration.is_zero() => Ok(duration),
            _ => Err(format!("{name} {value}: must be a number of seconds above 0")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses `args` (without the program name) into a config, or the error text.
    fn parse(args: &[&str]) -> Result<RouterConfig, String> {
        match parse_args(args.iter().map(|arg| arg.to_string()))? {
            Command::Run(config) => Ok(config),
            Command::Help => Err("help".into()),
        }
    }

    #[test]
    fn defaults_fill_every_flag_not_given() {
        let config = parse(&["--worker", "http://127.0.0.1:8001"]).unwrap();
        assert_eq!(config.host, "127.0.0.1");
        assert_eq!(config.port, 8000);
        assert_eq!(config.policy, PolicyKind::CacheAware);
        assert_eq!(config.thresholds.cache_threshold, 0.5);
        assert_eq!(config.thresholds.balance_abs_threshold, 32);
        assert_eq!(config.thresholds.balance_rel_threshold, 1.5);
        assert_eq!(config.max_tree_chars, 2_000_000);
        assert_eq!(config.health_interval, Duration::from_secs(1));
        assert_eq!(config.request_timeout, Duration::from_secs(600));
        assert_eq!(config.shutdown_timeout, Duration::from_secs(30));
        assert_eq!(config.max_retries, 2);
        assert_eq!(config.api_key, None);
    }

    #[test]
    fn workers_repeat_and_values_may_follow_an_equals_sign() {
        let config = parse(&[
            "--worker=http://a:1",
            "--worker",
            "http://b:2/",
            "--policy=round_robin",
            "--health-interval",
            "0.25",
            "--api-key",
            "secret",
        ])
        .unwrap();
        let urls: Vec<&str> = config.workers.iter().map(WorkerUrl::as_str).collect();
        assert_eq!(urls, ["http://a:1", "http://b:2"]);
        assert_eq!(config.policy, PolicyKind::RoundRobin);
        assert_eq!(config.health_interval, Duration::from_millis(250));
        assert_eq!(config.api_key.as_deref(), Some("secret"));
    }

    #[test]
    fn bad_values_name_the_flag_and_what_it_accepts() {
        let error = |args: &[&str]| parse(args).unwrap_err();
        assert!(error(&["--port", "http"]).starts_with("--port http:"));
        assert!(error(&["--cache-threshold", "1.5"]).contains("between 0 and 1"));
        assert!(error(&["--balance-rel-threshold", "0.5"]).contains("at least 1"));
        assert!(error(&["--health-interval", "0"]).contains("seconds above 0"));
        assert!(error(&["--request-timeout", "-1"]).contains("seconds above 0"));
        assert!(error(&["--max-tree-chars", "0"]).contains("above 0"));
        assert!(error(&["--policy", "fastest"]).contains("cache_aware, round_robin"));
        assert!(error(&["--worker", "https://a:1"]).contains("http://"));
        assert!(error(&["--port"]).contains("needs a value"));
        assert!(error(&["--port", "1", "--port", "2"]).contains("given twice"));
        assert!(error(&["--verbose"]).contains("unknown argument '--verbose'"));
    }

    #[test]
    fn help_is_a_command_and_the_usage_lists_every_flag_with_its_default() {
        assert_eq!(parse_args(["--help".to_string()]), Ok(Command::Help));
        let usage = usage();
        for flag in FLAGS {
            assert!(usage.contains(flag.name), "{}", flag.name);
        }
        assert!(usage.contains("(default cache_aware)"));
    }
}
