#!/usr/bin/env bash
# Kafka's command-line tools from the image's jars. Called as kafka-NAME.sh (a link to this file) it
# runs that tool, as Kafka's own bin/ does; called as kafka-run-class.sh, its first argument is the class.
set -euo pipefail
case "$(basename "$0")" in
    kafka-broker-api-versions.sh) main=org.apache.kafka.tools.BrokerApiVersionsCommand ;;
    kafka-topics.sh)              main=org.apache.kafka.tools.TopicCommand ;;
    kafka-consumer-groups.sh)     main=org.apache.kafka.tools.consumer.group.ConsumerGroupCommand ;;
    kafka-metadata-quorum.sh)     main=org.apache.kafka.tools.MetadataQuorumCommand ;;
    kafka-get-offsets.sh)         main=org.apache.kafka.tools.GetOffsetShell ;;
    kafka-console-consumer.sh)    main=org.apache.kafka.tools.consumer.ConsoleConsumer ;;
    kafka-console-producer.sh)    main=org.apache.kafka.tools.ConsoleProducer ;;
    kafka-configs.sh)             main=kafka.admin.ConfigCommand ;;
    kafka-storage.sh)             main=kafka.tools.StorageTool ;;
    *) main="${1:?usage: kafka-run-class.sh CLASS [ARGS...]}"; shift ;;
esac
# Tools are short-lived: a small heap, and the JIT's first tier only (a tool starts in about a second).
export KAFKA_LOG_LEVEL="${KAFKA_TOOL_LOG_LEVEL:-WARN}"
exec java ${KAFKA_TOOL_HEAP_OPTS:--Xmx256m} -XX:TieredStopAtLevel=1 \
    -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties \
    -cp '/opt/kafka/libs/*' "$main" "$@"
